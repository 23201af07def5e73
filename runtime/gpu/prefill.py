"""The GPU engine's prefill and its reference prefix cache (docs/gpu-engine.md, "Prefill").

The requests that join together go through every layer at once, each padded with text token 0 to the longest: their
rows share each GEMM (the prefill tiles', one K order for any number of rows), one launch writes every prompt's keys
and values straight into its slot's pages, and one prompt_attention launch per layer attends each row to its own
slot's keys 0..row. A row's numbers therefore depend neither on the padding nor on the other prompts of the pass, nor
on where the pass starts: the keys and values of a prompt's first rows are the same whether the pass holds the whole
prompt or only those rows.

That makes the prefix cache exact. A prompt's reference part (Prompt.prefix: <|tts|> and the voice's reference block,
the same for every request in that voice) is computed in a whole-prompt prefill on a miss, and its keys and values
are then kept (runtime/prefix_cache.py: bounded, least recently used first out, one cache per engine), as a copy of
the pages that hold them; on a hit those are copied into the slot's first pages and the pass takes only the rows
after them, starting at position `prefix`. Hits and misses prefill in the same passes, bucketed by the rows each one
still needs.
"""

import numpy as np
import torch
import torch.nn.functional as F

from higgs_trt.plugins import attention, engine_kernels, rope
from higgs_trt.runtime.decoding import NUM_CODEBOOKS, Sampling
from higgs_trt.runtime.prefix_cache import PrefixCache
from higgs_trt.runtime.prompt import Prompt

from .launches import ATTENTION_BLOCK, PROMPT_BUCKETS, PROMPT_Q_BLOCK

Join = tuple[int, Prompt, Sampling]


class Prefill:
    """GpuEngine's prefill passes (GpuEngine.prefill cuts a wave of joins into them): the engine's layers, activation
    buffers and kernels, fed from its prompt buffers."""

    def _prefill_buffers(self, rows: int, pinned: bool, prefix_entries: int) -> None:
        """Prefill input (rows of id, audio row, flag; per prompt its last row, first position and slot), up from
        pinned buffers; the prefix cache."""
        dev, b = self.device, self.max_batch
        self.prefixes = PrefixCache(prefix_entries)
        self.prompt_counts: dict[int, int] = {}  # length bucket → the most prompts a captured prefill graph holds
        self.prompt_buckets = sorted({min(n, self.max_prompt) for n in PROMPT_BUCKETS})
        self.prompt_in = torch.zeros(rows, 2 + NUM_CODEBOOKS, dtype=torch.int64, device=dev)
        self.prompt_at = torch.zeros(3, b, dtype=torch.int64, device=dev)
        self.prompt_last, self.prompt_start, self.prompt_slot = self.prompt_at
        self.host_prompt = torch.zeros(self.prompt_in.shape, dtype=torch.int64, pin_memory=pinned)
        self.host_at = torch.zeros(self.prompt_at.shape, dtype=torch.int64, pin_memory=pinned)
        self.host_at[2] = -1  # the warm-up and capture passes write no slot
        self.prompt_at.copy_(self.host_at)
        self.prompt_copied = torch.cuda.Event() if pinned else None
        self.prompt_h = torch.zeros(rows, self.cfg.hidden_size, dtype=torch.bfloat16, device=dev)

    def _capture_prefills(self) -> None:
        """A graph per count and length bucket whose rows fit a pass: joins spread over time (a server's) come in many
        small groups, each far cheaper replayed than issued eagerly. The graphs share one pool: they run one after
        another on the engine's stream."""
        pool = torch.cuda.graph_pool_handle()
        for length in self.prompt_buckets:
            for count in (n for n in self.buckets if n * length <= self.pass_rows):
                self._prefill_padded(count, length)  # warm-up (and Triton's compiles for these rows)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, stream=self.stream, pool=pool):
                    self._prefill_padded(count, length)
                self.graphs["prompt", count, length] = graph
                self.prompt_counts[length] = count

    def _cached_reference(self, slot: int, prompt: Prompt) -> int:
        """The position the prompt's prefill starts at: past its reference part where the prefix cache holds it (its
        keys and values then copied into the slot), else 0."""
        if not 0 < prompt.prefix < len(prompt):
            return 0
        kept = self.prefixes.get(prompt.prefix_key)
        if kept is None:
            return 0
        self.kv.put(slot, kept)
        return prompt.prefix

    def _prefill_group(self, group: list[Join], starts: list[int]) -> None:
        g, longest = len(group), max(len(prompt) - start for (_, prompt, _), start in zip(group, starts))
        bucket = next((n for n in self.prompt_buckets if n >= longest), None)
        graph = self.graphs.get(("prompt", self.bucket_of[g], bucket))
        count, length = (self.bucket_of[g], bucket) if graph is not None else (g, longest)
        self._stage_prompts([(slot, prompt, start) for (slot, prompt, _), start in zip(group, starts)], length, count)
        if graph is not None:
            graph.replay()
        else:
            self._prefill_padded(g, length)
        for (slot, prompt, _), start in zip(group, starts):
            # a miss keeps its reference part (once per voice: the same voice may miss twice in one wave)
            if (not start and 0 < prompt.prefix < len(prompt) and self.prefixes.entries > 0
                    and prompt.prefix_key not in self.prefixes.kept):
                self.prefixes.put(prompt.prefix_key, self.kv.take(slot, prompt.prefix))
        self._start([(slot, len(prompt), sampling) for slot, prompt, sampling in group])
        self._record("first", [slot for slot, _, _ in group])

    def _stage_prompts(self, prompts: list[tuple[int, Prompt, int]], length: int, count: int) -> None:
        """Prefill input for (slot, prompt, start) entries: each prompt's rows from `start` on, padded with text token 0
        to `length` rows, one after another, then empty prompts up to `count` (a graph's count bucket: their rows are
        computed and never read or written into a slot); each one's last row, first position and slot."""
        if self.prompt_copied is not None:
            self.prompt_copied.synchronize()  # the previous prefill's copies have left the pinned buffers
        host, at = self.host_prompt.numpy(), self.host_at.numpy()
        rows = count * length
        host[:rows] = 0
        at[0, :count], at[1, :count], at[2, :count] = np.arange(count) * length, 0, -1
        for j, (slot, prompt, start) in enumerate(prompts):
            r, n = j * length, len(prompt) - start
            host[r:r + n, 0], host[r:r + n, -1] = prompt.input_ids[start:], prompt.is_audio[start:]
            host[r:r + n, 1:-1] = prompt.audio_rows[start:]
            at[:, j] = r + n - 1, start, slot
        self.prompt_in[:rows].copy_(self.host_prompt[:rows], non_blocking=True)
        self.prompt_at.copy_(self.host_at, non_blocking=True)
        if self.prompt_copied is not None:
            self.prompt_copied.record()

    def _prefill_padded(self, g: int, length: int) -> None:
        """g staged prompts of `length` rows through every layer (rows of different prompts share each GEMM, whose K
        order does not depend on the rows, so a row's numbers depend neither on the others nor on the padding), their
        keys and values into their slots from their first positions on, the logits of each one's last row into
        logits[:g]. Captured for each count and length bucket that fits a pass (_capture_prefills): the page table it
        writes through is read when it runs."""
        cfg, ws = self.cfg, self.workspace
        hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        p = g * length
        inp, h = self.prompt_in[:p], self.prompt_h[:p]
        qkv, q, attn, act = self.qkv_out[:p], self.q[:p], self.attn[:p], self.act[:p]
        text = F.embedding(inp[:, 0], self.text_table)
        ref = F.embedding(inp[:, 1:-1] + self.offsets, self.table).float().sum(1).to(torch.bfloat16)
        h.copy_(torch.where(inp[:, -1:] != 0, ref, text))
        heads = self.heads[:p].view(g, hq, length, d)
        for i, layer in enumerate(self.layers):
            x = self._norm(h, layer.input_norm, p, layer.qkv)
            layer.qkv(x, qkv, p, ws, prefill=True)
            k_cache, v_cache = self.caches[i, 0], self.caches[i, 1]
            rope.qk_norm_rope_kv_write[(p,)](
                qkv, layer.q_norm, layer.k_norm, self.cos, self.sin, self.prompt_start, self.prompt_slot,
                self.prompt_last, self.kv.table, q, k_cache, v_cache, length, self.max_seq, cfg.rms_norm_eps,
                Q_HEADS=hq, KV_HEADS=hkv, HALF=d // 2, PAGE=self.kv.page, **self._launch())
            # causal attention over each prompt's own keys only (a row reads keys 0..its position of its slot, so its
            # result depends neither on the padding nor on the other prompts): q scaled as decode scales it, heads
            # first, at the graph's bf16 scale; the output goes through q's buffer (q is spent) back to rows first
            heads.copy_(q.view(g, length, hq, d).transpose(1, 2).float() * self.q_scale)
            out = q.view(g, hq, length, d)
            attention.prompt_attention[(g, hkv, -(-length * (hq // hkv) // PROMPT_Q_BLOCK))](
                heads, k_cache, v_cache, self.prompt_start, self.prompt_slot, self.kv.table, length, self.max_seq, out,
                Q_HEADS=hq, KV_HEADS=hkv, HEAD_DIM=d, BLOCK_Q=PROMPT_Q_BLOCK, BLOCK_S=ATTENTION_BLOCK,
                PAGE=self.kv.page)
            attn.view(g, length, hq, d).copy_(out.transpose(1, 2))
            if layer.o.fp8:
                engine_kernels.quantize_rows[(p, -(-hq * d // 1024))](attn, self.attn8, layer.o.x_scale, N=hq * d,
                                                                   BLOCK=1024, **self._launch())
            layer.o(self.attn8[:p] if layer.o.fp8 else attn, h, p, ws, residual=True, prefill=True)
            x = self._norm(h, layer.post_norm, p, layer.gate_up)
            layer.gate_up(x, act, p, ws, out_scale=layer.down.x_scale, prefill=True)
            layer.down(act, h, p, ws, residual=True, prefill=True)
        x = self._norm(h.index_select(0, self.prompt_last[:g]), self.final_norm, g)
        self.head(x, self.logits[:g], g, ws)
