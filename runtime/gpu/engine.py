"""The engine design on a CUDA GPU without TensorRT: KV slots, the plugin kernels, CUDA graphs, FP8 GEMMs.

This is `--backend torch` on a GPU and the measure of what the engines cost on real hardware. It keeps the engine's
contract (slots, a prefill into each, one step for the first n slots) and runs every decode-step operation as one of
the project's kernels:

  per layer: rms_norm → linear(q|k|v) → decode_attention_split (q/k norm and RoPE, k and v written into the cache
             in place, attention over each row's valid prefix only) → linear(o) + residual → rms_norm →
             linear(gate, up) · silu → linear(down) + residual
  then:      rms_norm → linear(audio table) → delayed_codebook_sample (argmax or seeded sampling, delay mask, end
             frame, next row's embedding) → advance_slots

A slot's cache is the pages it holds in one pool (kv_pages.py): as many as its request's prompt and row cap need
(reserve), so more slots fit in the memory than at max_seq each.

All state a step needs lives on the device (positions, row index, end frame, sampling parameters, the next
embedding, the page table), so step n+1 follows step n without the host; the host reads each step's codes from
pinned memory one step late. A step is replayed from a CUDA graph per batch bucket, captured at start-up. The kernels
are batch invariant (plugins/), so a request's codes do not depend on what else is in the batch.

FP8 (--precision fp8): per-output-channel FP8 weights and the calibration's static per-tensor activation scales, the
quantisation of the FP8 engine (plugins/fp8.py), executed by the linear kernel's FP8 path (not torch._scaled_mm,
which is slower than BF16 at decode sizes). Activations are quantized once, by
the kernel that produces them (the norms, decode attention, gate|up; in a prefill, quantize_rows after attention).
The audio table stays bf16.

Prefill (prefill.py) takes the requests that join together, padded to the longest: their rows go through the same
linear kernel at once, summed in one K order for any number of rows (the prefill tiles'), so a row's numbers never
depend on the other requests, and each row attends to its own slot's keys 0..row. A voice's reference part comes
from the prefix cache where it is kept, and the prefill then takes only the rows after it.

Batch buckets, prefill passes and decode attention's settings: launches.py; the codec's graphs: codec_graphs.py.
"""

import threading
import time

import numpy as np
import torch

from higgs_trt.plugins import attention, codebook, engine_kernels
from higgs_trt.plugins.fp8 import FP8_CODES, fake_quantize_weight
from higgs_trt.plugins.rope_table import rope_table
from higgs_trt.runtime import extras
from higgs_trt.runtime.config import AUDIO_TABLE, TEXT_EMBEDDING, HiggsConfig, lm_tensor_shapes
from higgs_trt.runtime.decoding import NUM_CODEBOOKS, Sampling
from higgs_trt.runtime.generate import NO_END
from higgs_trt.runtime.prefix_cache import DEFAULT_ENTRIES
from higgs_trt.runtime.prompt import Prompt
from higgs_trt.runtime.slots import Decoded, SlotEngine
from higgs_trt.runtime.streaming import StreamPlan

from .codec_graphs import CodecGraphs, PendingAudio, Pieces
from .kv_pages import PAGE, KvPages, position_bytes
from .launches import (ATTENTION_BLOCK, ATTENTION_CHUNK, ATTENTION_LATE_LAUNCH_BUCKETS, ATTENTION_PREFETCH_ROWS,
                       ATTENTION_TMA_BUCKETS, ATTENTION_WARPS, BUCKETS, PREFILL_PROMPTS, STEP_ROWS, Workspace,
                       attention_stages, attention_tma, bucket_table, prefill_passes, slot_runs)
from .linear import Layer, Linear
from .prefill import Prefill
from .weights import WeightSource

_claimed = threading.local()  # the engine stream each thread has made current (GpuEngine._claim_stream)
# GPU memory the default cache budget leaves free for everything allocated after the caches: activations, graphs,
# the codec's graphs and the prefix cache (2.7 GiB besides weights and caches at 64 slots, H200, 0c5e456; the prefix
# cache up to ~1.2 GiB)
CACHE_HEADROOM = 6 << 30


class GpuEngine(Prefill, SlotEngine):
    """Slots × (KV cache + decode state) on one CUDA device; see the module docstring."""

    name = "torch-cuda"
    lag = 1  # a step's codes are read after the next step is launched

    def __init__(self, cfg: HiggsConfig, tensors: dict, *, max_seq: int, max_batch: int, max_prompt: int,
                 act_amax: dict | None = None, codec=None, device: str = "cuda", graphs: bool = True,
                 pdl: bool | None = None, prefix_entries: int = DEFAULT_ENTRIES, cache_positions: int | None = None,
                 page: int = PAGE):
        """cache_positions: the KV cache's size, in positions of all slots together (None: max_batch × max_seq,
        or what the GPU's free memory holds less CACHE_HEADROOM if that is less); page: positions a page (the
        tests' fixed slots: max_seq)."""
        self.cfg, self.max_seq, self.max_batch, self.max_prompt = cfg, max_seq, max_batch, max_prompt
        self.device = torch.device(device)
        self.precision = "fp8" if act_amax else "bf16"
        dev = self.device
        t = {name: tensor.to(dev, torch.bfloat16) for name, tensor in tensors.items()}
        self.layers = [Layer(cfg, t, f"body.layers.{i}.", act_amax) for i in range(cfg.num_layers)]
        self.final_norm = t["body.norm.weight"]
        self.table = t[AUDIO_TABLE]  # the audio embedding and the head (bf16 in both precisions)
        self.head = Linear(self.table)
        self.text_table = t[TEXT_EMBEDDING]
        if act_amax:  # the FP8 engine stores the text table in FP8 with a scale per row (calibration/qdq.py)
            self.text_table = fake_quantize_weight(self.text_table).to(torch.bfloat16)
        del t
        self.cos, self.sin = (x.to(dev) for x in rope_table(cfg, max_seq, torch.bfloat16))
        self.q_scale = float(torch.tensor(cfg.head_dim ** -0.5).bfloat16())  # 1/√D as the graph has it: bf16
        self.offsets = torch.arange(cfg.num_codebooks, device=dev) * cfg.codebook_vocab
        self.codec_model = codec
        self.codec_strides = codec.dims.strides if codec is not None else None
        self.codec_calls = CodecGraphs(codec, max_batch, dev) if codec is not None else None

        h, d, hq, hkv = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        # activation rows: the most one prefill pass holds (a decode step takes max_batch of them)
        rows = self.pass_rows = max(max_batch, PREFILL_PROMPTS * max_prompt)
        bf16 = dict(dtype=torch.bfloat16, device=dev)
        pinned = dev.type == "cuda"
        if cache_positions is None:
            cache_positions = max_batch * max_seq
            if dev.type == "cuda":
                free = torch.cuda.mem_get_info(dev)[0] - CACHE_HEADROOM
                cache_positions = min(cache_positions, max(free, 0) // position_bytes(cfg))
        self.kv = KvPages(cfg, max_batch, max_seq, cache_positions, dev, pinned, page)
        self.caches = self.kv.pool  # [layers, K/V, pages, Hkv, page, D]
        # each layer's decode attention by bulk copies (ATTENTION_TMA_BUCKETS)
        self.attention_tma = [attention_tma(self.caches[i, 0], self.caches[i, 1]) for i in range(cfg.num_layers)]
        self.h = torch.zeros(max_batch, h, **bf16)  # residual stream; the codebook kernel leaves the next input here
        self.x = torch.zeros(rows, h, **bf16)  # normed rows for bf16 linears and the head
        fp8 = self.precision == "fp8"  # FP8: the norms give q|k|v and gate|up codes, gate|up gives down codes
        self.x8 = torch.zeros(rows, h, dtype=FP8_CODES, device=dev) if fp8 else None
        self.qkv_out = torch.zeros(rows, (hq + 2 * hkv) * d, **bf16)
        self.q = torch.zeros(rows, hq * d, **bf16)  # a prefill's q after norm and RoPE
        self.attn = torch.zeros(rows, hq * d, **bf16)
        self.attn8 = torch.zeros(rows, hq * d, dtype=FP8_CODES, device=dev) if fp8 else None  # o's input as codes
        self.heads = torch.zeros(rows, hq * d, **bf16)  # a prefill's scaled q, heads first
        self.act = torch.zeros(rows, cfg.intermediate_size, dtype=FP8_CODES if fp8 else torch.bfloat16, device=dev)
        self.logits = torch.zeros(max_batch, cfg.audio_table_rows, dtype=torch.float32, device=dev)
        self.codes = torch.zeros(max_batch, NUM_CODEBOOKS, dtype=torch.int32, device=dev)
        self.end_next = torch.zeros(max_batch, dtype=torch.int64, device=dev)
        # per-slot decode state
        i64 = dict(dtype=torch.int64, device=dev)
        self.write_pos = torch.zeros(max_batch, **i64)
        self.row_index = torch.zeros(max_batch, **i64)
        self.end_frame = torch.full((max_batch,), int(NO_END), **i64)
        self.active = torch.zeros(max_batch, dtype=torch.int32, device=dev)
        self.temperature = torch.zeros(max_batch, dtype=torch.float32, device=dev)
        self.top_k = torch.zeros(max_batch, dtype=torch.int32, device=dev)
        self.top_p = torch.ones(max_batch, dtype=torch.float32, device=dev)
        self.seed = torch.zeros(max_batch, **i64)
        self.limit = torch.full((max_batch,), max_seq, **i64)  # positions the slot's pages hold
        n_max = max(lin.n for lin in (self.layers[0].qkv, self.layers[0].gate_up, self.head))
        if pdl is None:  # Hopper on (griddepcontrol); launched without it, the kernels' waits are no-ops
            pdl = dev.type == "cuda" and torch.cuda.get_device_capability(dev) >= (9, 0)
        self.workspace = Workspace(n_max, max_batch, hq, hkv, d, max_seq, dev, pdl)

        self.stream = torch.cuda.Stream(dev) if dev.type == "cuda" else None
        self.buckets, self.bucket_of = bucket_table(BUCKETS, max_batch)
        self.step_rows = {n: STEP_ROWS.get(n, 1) for n in self.buckets}
        rows_max = max(self.step_rows.values())
        self.host_codes = [torch.zeros(rows_max, max_batch, NUM_CODEBOOKS, dtype=torch.int32, pin_memory=pinned)
                           for _ in range(2)]
        self.host_first = torch.zeros(max_batch, NUM_CODEBOOKS, dtype=torch.int32, pin_memory=pinned)
        self.host_codes_np = [t.numpy() for t in self.host_codes]
        self.host_first_np = self.host_first.numpy()
        self.step_slots = {n: list(range(n)) for n in self.buckets}  # the slots a step of bucket n covers
        self.epochs = [0] * max_batch  # bumped by each prefill: rows launched before it belong to the old request
        self.live = [False] * max_batch
        self.pending: list = []  # launches whose codes the host has not read: (event, kind, slots, epochs, parity, rows)
        self.events: list = []  # recorded events done with, for reuse (creating one per step costs host time)
        self.waited = 0.0  # seconds the host spent waiting for the GPU in rows() (timers())
        self.prefill_seconds = 0.0
        self.parity = 0
        self.graphs: dict = {}
        self._prefill_buffers(rows, pinned, prefix_entries)
        # a starting slot's decode state, written on the host and copied up (GpuEngine._start)
        self.states = (self.write_pos, self.row_index, self.end_frame, self.active, self.temperature, self.top_k,
                       self.top_p, self.seed, self.limit)
        self.host_state_tensors = [torch.zeros(max_batch, dtype=t.dtype, pin_memory=pinned) for t in self.states]
        self.host_states = [t.numpy() for t in self.host_state_tensors]
        self.states_copied = torch.cuda.Event() if pinned else None
        if graphs and dev.type == "cuda":
            self._capture_all()
            if codec is not None:
                self.prepare_codec(StreamPlan.exact(self.codec_strides))

    # ---- the step ------------------------------------------------------------------------------------------------

    def decode_step(self, n: int) -> None:
        """Every kernel of one decode step for slots [0, n), launched eagerly: the work a step's graph replays (the
        benchmarks capture it at their own context lengths)."""
        cfg, ws = self.cfg, self.workspace
        hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        h = self.h[:n]
        for i, layer in enumerate(self.layers):
            x = self._norm(h, layer.input_norm, n, layer.qkv)
            layer.qkv(x, self.qkv_out, n, ws)
            attn = self.attn8 if layer.o.fp8 else self.attn
            tma = self.attention_tma[i] if n in ATTENTION_TMA_BUCKETS else {}
            attention.decode_attention_split[(n, hkv, ws.chunks)](
                self.qkv_out, layer.q_norm, layer.k_norm, self.cos, self.sin, self.caches[i, 0], self.caches[i, 1],
                self.write_pos, attn, ws.attn_partials, ws.attn_stats, ws.attn_tickets, self.max_seq, cfg.rms_norm_eps,
                layer.o.x_scale, Q_HEADS=hq, KV_HEADS=hkv, HEAD_DIM=d, CHUNK=ATTENTION_CHUNK, BLOCK_S=ATTENTION_BLOCK,
                MAX_CHUNKS=ws.chunks, OUT_FP8=layer.o.fp8, num_stages=attention_stages(n),
                num_warps=ATTENTION_WARPS, PREFETCH=self.pdl and n <= ATTENTION_PREFETCH_ROWS,
                LATE_LAUNCH=n in ATTENTION_LATE_LAUNCH_BUCKETS, pages=self.kv.table, active=self.active,
                PAGE=self.kv.page, **tma, **self._launch())
            layer.o(attn, h, n, ws, residual=True)
            x = self._norm(h, layer.post_norm, n, layer.gate_up)
            layer.gate_up(x, self.act, n, ws, out_scale=layer.down.x_scale)
            layer.down(self.act, h, n, ws, residual=True)
        x = self._norm(h, self.final_norm, n)
        self.head(x, self.logits, n, ws)
        self._choose(n, self.logits, self.h, self.codes)
        self._advance(0, n)

    def _norm(self, src: torch.Tensor, weight: torch.Tensor, rows: int, into: Linear | None = None) -> torch.Tensor:
        """rms_norm of src[:rows] as the input of `into`: FP8 codes at its activation scale when it is an FP8
        linear (quantized once here instead of in every program of the GEMM), else bf16."""
        fp8 = into is not None and into.fp8
        out = (self.x8 if fp8 else self.x)[:rows]
        h = self.cfg.hidden_size
        engine_kernels.rms_norm[(rows,)](src, weight, out, self.cfg.rms_norm_eps, into.x_scale if fp8 else 1.0, H=h,
                                      BLOCK=1 << (h - 1).bit_length(), OUT_FP8=fp8, **self._launch())
        return out

    @property
    def pdl(self) -> bool:
        return self.workspace.pdl

    def _launch(self) -> dict:
        return dict(PDL=self.pdl, launch_pdl=self.pdl)

    def _choose(self, n: int, logits: torch.Tensor, embedding: torch.Tensor, codes: torch.Tensor, slot: int = 0) -> None:
        """delayed_codebook_sample for slots [slot, slot + n) (logits and outputs are indexed from their row 0)."""
        cfg = self.cfg
        block_h = min(1 << (cfg.hidden_size - 1).bit_length(), 512)
        s = slice(slot, slot + n)
        codebook.delayed_codebook_sample[(n, -(-cfg.hidden_size // block_h))](
            logits, self.row_index[s], self.end_frame[s], self.table, self.temperature[s], self.top_k[s],
            self.top_p[s], self.seed[s], codes, embedding, self.end_next[s], K=cfg.num_codebooks,
            VOCAB=cfg.codebook_vocab, HIDDEN=cfg.hidden_size, BLOCK_V=1 << (cfg.codebook_vocab - 1).bit_length(),
            BLOCK_H=block_h, num_warps=8, **self._launch())

    def _advance(self, slot: int, n: int) -> None:
        s = slice(slot, slot + n)
        engine_kernels.advance_slots[(1,)](self.write_pos[s], self.row_index[s], self.end_frame[s], self.end_next[s],
                                        self.active[s], self.limit[s], n, BLOCK=max(16, 1 << (n - 1).bit_length()),
                                        **self._launch())

    def step_graph(self, n: int) -> "torch.cuda.CUDAGraph":
        """The captured one-row step of the bucket that holds n slots (benchmarks replay it)."""
        return self.graphs[self.bucket_of[n], 0, 1]

    def _decode_rows(self, n: int, rows: int, parity: int) -> None:
        """`rows` decode steps for slots [0, n), each step's codes copied to the parity's pinned buffer."""
        for r in range(rows):
            self.decode_step(n)
            self.host_codes[parity][r, :n].copy_(self.codes[:n], non_blocking=self.stream is not None)

    def _capture_all(self) -> None:
        """One graph per (bucket, parity, rows per replay), captured once: the parity picks the pinned buffer its
        codes go to."""
        with torch.cuda.stream(self.stream):
            for n in self.buckets:
                self.decode_step(n)  # compile and warm up outside capture
            torch.cuda.current_stream().synchronize()
            self.write_pos.zero_()
            for n in self.buckets:
                for parity in (0, 1):
                    for rows in {1, self.step_rows[n]}:
                        graph = torch.cuda.CUDAGraph()
                        with torch.cuda.graph(graph, stream=self.stream):
                            self._decode_rows(n, rows, parity)
                        self.graphs[n, parity, rows] = graph
            self._capture_prefills()
        self.caches.zero_()

    # ---- the scheduler's contract (runtime/scheduler.py) -----------------------------------------------------------

    def prepare_codec(self, plan: StreamPlan) -> None:
        """The plan's codec windows as CUDA graphs (CodecGraphs.prepare): the default plan's at start-up, another
        plan's when a scheduler with it starts."""
        if self.codec_calls is not None and self.graphs:
            self.codec_calls.prepare(plan)

    @torch.inference_mode()
    def prefill(self, joins: list[tuple[int, Prompt, Sampling]]) -> None:
        """Fill each join's slot from its prompt and choose its row 0 on the device, in passes of several prompts,
        each one from past its reference part where the prefix cache holds that (prefill.py): a request prefills to
        the same state alone or with others, from the cache or not."""
        t0 = time.perf_counter()
        for slot, prompt, _ in joins:
            if len(prompt) > self.max_prompt:
                raise ValueError(f"prompt of {len(prompt)} tokens exceeds max_prompt {self.max_prompt}")
            if not self.kv.held[slot] and not self.kv.reserve(slot, self.max_seq):  # unreserved: max_seq, as before
                raise ValueError(f"no cache pages left for slot {slot}")
            if len(prompt) > self.kv.capacity(slot):
                raise ValueError(f"prompt of {len(prompt)} tokens exceeds slot {slot}'s {self.kv.capacity(slot)} "
                                 "reserved positions")
        self._claim_stream()
        self.kv.upload()
        starts = [self._cached_reference(slot, prompt) for slot, prompt, _ in joins]
        rests = [len(prompt) - start for (_, prompt, _), start in zip(joins, starts)]
        first = 0
        for count in prefill_passes(rests, self.pass_rows, self.prompt_counts):
            self._prefill_group(joins[first:first + count], starts[first:first + count])
            first += count
        self.prefill_seconds += time.perf_counter() - t0

    def _start(self, starts: list[tuple[int, int, Sampling]]) -> None:
        """Slots whose prompts are cached start decoding: (slot, prompt rows, sampling) of the j-th prompt of the pass
        just run, its row 0 chosen from logits[j]. The states go up from pinned buffers, and a run of consecutive slots
        (a wave of joins takes consecutive slots) is one copy per state and one codebook launch, not one per slot."""
        cfg = self.cfg
        if self.states_copied is not None:
            self.states_copied.synchronize()  # the previous start's copies have left the pinned buffers
        for slot, n, sampling in starts:
            values = (n - 1,  # advance_slots moves it to n, where row 0 is fed back
                      0, int(NO_END), 1, max(sampling.temperature, 0.0),
                      min(sampling.top_k, cfg.codebook_vocab),  # ≥ the vocabulary: every code
                      sampling.top_p, sampling.seed, self.kv.capacity(slot))
            for host, value in zip(self.host_states, values):
                host[slot] = value
        for j, slot, count in slot_runs([slot for slot, _, _ in starts]):
            s = slice(slot, slot + count)
            for state, host in zip(self.states, self.host_state_tensors):
                state[s].copy_(host[s], non_blocking=True)
            self._choose(count, self.logits[j:j + count], self.h[s], self.codes[s], slot)
            self._advance(slot, count)
            self.host_first[s].copy_(self.codes[s], non_blocking=True)
        if self.states_copied is not None:
            self.states_copied.record()
        for slot, _, _ in starts:
            self.epochs[slot] += 1
            self.live[slot] = True

    def _claim_stream(self) -> None:
        """Make the engine's stream the calling thread's current one, where every later launch of this thread goes
        (the thread that drives an engine runs on its stream). Once per thread and engine: a `with
        torch.cuda.stream(...)` around each step costs more host time than the step's graph launch."""
        if self.stream is not None and getattr(_claimed, "stream", None) is not self.stream:
            torch.cuda.set_stream(self.stream)
            _claimed.stream = self.stream

    def step(self, n: int, rows: int = 1) -> int:
        """One row, or `rows` where the bucket replays that many (STEP_ROWS), for every active slot below n
        (inactive ones compute rows nobody reads); returns how many."""
        n = self.bucket_of[n]
        rows = self.step_rows[n] if rows >= self.step_rows[n] else 1
        self._claim_stream()
        if self.graphs:
            self.graphs[n, self.parity, rows].replay()
        else:
            self._decode_rows(n, rows, self.parity)
        self._record("step", self.step_slots[n], self.parity, rows)
        self.parity ^= 1
        return rows

    def _record(self, kind: str, slots: list[int], parity: int = 0, rows: int = 1) -> None:
        event = None
        if self.stream is not None:
            event = self.events.pop() if self.events else torch.cuda.Event()
            event.record(self.stream)
        self.pending.append((event, kind, slots, [self.epochs[s] for s in slots], parity, rows))

    def rows(self, keep: int = 0) -> list[tuple[int, list[int]]]:
        """(slot, its 8 codes) of every launch done, oldest first (a launch of several rows: row by row), waiting
        until at most `keep` are pending; rows of slots released or refilled since their launch are dropped."""
        out = []
        while self.pending and (len(self.pending) > keep or self.pending[0][0] is None or self.pending[0][0].query()):
            event, kind, slots, epochs, parity, rows = self.pending.pop(0)
            if event is not None:
                t0 = time.perf_counter()
                event.synchronize()
                self.waited += time.perf_counter() - t0
                self.events.append(event)
            last = max(slots) + 1
            step_codes = ([self.host_first_np[:last].tolist()] if kind == "first"
                          else self.host_codes_np[parity][:rows, :last].tolist())
            for codes in step_codes:
                out += [(s, codes[s]) for s, e in zip(slots, epochs) if self._live(s, e)]
        return out

    def busy(self) -> bool:
        """The last launch (step or prefill) still runs on the GPU."""
        return bool(self.pending) and self.pending[-1][0] is not None and not self.pending[-1][0].query()

    def _live(self, slot: int, epoch: int) -> bool:
        return epoch == self.epochs[slot] and self.live[slot]

    def reserve(self, slot: int, positions: int) -> bool:
        """Cache pages for `positions` in `slot` (kv_pages.py); a prefill of a slot that reserved none takes max_seq."""
        return self.kv.reserve(slot, positions)

    def release(self, slot: int) -> None:
        """Inactive from the next launch on (an inactive slot's steps write no key or value), its pages free."""
        self.live[slot] = False
        self._claim_stream()
        self.active[slot:slot + 1].fill_(0)
        self.kv.release(slot)

    def codec(self, codes: np.ndarray, keep: tuple[int, int] | None = None) -> "PendingAudio | Decoded | Pieces":
        """Codec windows decoded on the codec stream while decode steps go on in the engine stream (the scheduler
        collects the audio when it is ready)."""
        return self.codec_calls(codes, keep)

    def reset_timers(self) -> None:
        """Zero the host-time counters that timers() reads."""
        self.waited = self.prefill_seconds = self.codec_calls.waited = 0.0
        self.codec_calls.seconds.clear()

    def timers(self) -> dict[str, float]:
        """Host seconds since reset_timers(): waiting for the GPU (steps and codec calls), issuing prefills, issuing
        codec calls (`bench decode` subtracts them from the loop's wall time to get its own work)."""
        return {"waited": self.waited + self.codec_calls.waited, "prefill": self.prefill_seconds,
                "codec": sum(self.codec_calls.seconds)}


def load_gpu_engine(source: WeightSource, *, max_seq: int, max_batch: int, max_prompt: int, act_amax: dict | None = None,
                    codec_fp16: bool = True, cache_gib: float | None = None, say=lambda msg: None) -> GpuEngine:
    """A GpuEngine from a Checkpoint or an EngineWeights (an engine directory's weights.bin): the language model's
    tensors by their checkpoint names, the codec decoder on the same device (its convolutions in fp16 unless
    `codec_fp16` is off: TF32 then; CodecDecoder.fp16), a KV cache of `cache_gib` GiB (None: GpuEngine's default)."""
    from .codec import CodecDecoder

    extras.require_cuda("the GPU engine")
    cfg = source.config
    tensors = source.take(lm_tensor_shapes(cfg), "language model")
    codec = CodecDecoder.from_checkpoint(source).channels_last().to("cuda")
    if codec_fp16:
        codec.fp16()
    say(f"  capturing decode graphs for batches {', '.join(map(str, bucket_table(BUCKETS, max_batch)[0]))}…")
    positions = None if cache_gib is None else int(cache_gib * (1 << 30)) // position_bytes(cfg)
    engine = GpuEngine(cfg, tensors, max_seq=max_seq, max_batch=max_batch, max_prompt=max_prompt, act_amax=act_amax,
                       codec=codec, cache_positions=positions)
    kv = engine.kv
    say(f"  KV cache: {kv.pages * kv.page:,} positions ({kv.pool.nbytes / (1 << 30):.1f} GiB) for {max_batch} slots "
        f"of up to {max_seq}")
    return engine
