"""The engine design on a CUDA GPU without TensorRT: static KV slots, the plugin kernels, CUDA graphs, FP8 GEMMs.

This is `--backend torch` on a GPU and the measure of what the engines cost on real hardware. It keeps the engine's
contract (fixed slots of [Hkv, S_max, D] caches, a prefill into one slot, one step for the first n slots) and runs
every decode-step operation as one of the project's kernels:

  per layer: rms_norm → linear(q|k|v) → decode_attention_split (q/k norm and RoPE, k and v written into the cache
             in place, attention over each row's valid prefix only) → linear(o) + residual → rms_norm →
             linear(gate, up) · silu → linear(down) + residual
  then:      rms_norm → linear(audio table) → delayed_codebook_sample (argmax or seeded sampling, delay mask, end
             frame, next row's embedding) → advance_slots

All state a step needs lives on the device (positions, row index, end frame, sampling parameters, the next
embedding), so step n+1 follows step n without the host; the host reads each step's codes from pinned memory one
step late. A step is replayed from a CUDA graph per batch bucket, captured at start-up. The kernels are batch
invariant (builder/gpu_kernels.py), so a request's codes do not depend on what else is in the batch.

FP8 (--precision fp8): per-output-channel FP8 weights and the calibration's static per-tensor activation scales, the
quantisation of the FP8 engine (calibration/qdq.py), executed by the linear kernel's FP8 path (not torch._scaled_mm,
which is slower than BF16 at decode sizes: ../shared/docs/gpu-measurements.md). Activations are quantized once, by
the kernel that produces them (the norms, decode attention, gate|up; in a prefill, quantize_rows after attention).
The audio table stays bf16.

Prefill takes the requests that join together, padded to the longest: their rows go through the same linear kernel
at once, summed in one K order for any number of rows (the prefill tiles'), so a row's numbers never depend on the
other requests, and one decode_attention launch per layer attends each row to its own prompt's keys 0..row. One
prompt alone replays the captured graph of its length bucket.
"""

import time
import threading

import numpy as np
import torch
import torch.nn.functional as F
from triton.tools.tensor_descriptor import TensorDescriptor

from higgs_trt.calibration.qdq import fake_quantize_weight
from higgs_trt.plugins import kernels as plugin_kernels
from higgs_trt.runtime.decoding import NUM_CODEBOOKS, Sampling
from higgs_trt.runtime import extras
from higgs_trt.runtime.generate import NO_END
from higgs_trt.runtime.prompt import Prompt
from higgs_trt.runtime.stepper import Decoded
from higgs_trt.runtime.streaming import StreamPlan

from . import gpu_kernels
from .gpu_linear import FP8_CODES, Linear
from .config import HiggsConfig
from .model import AUDIO_TABLE, TEXT_EMBEDDING, rope_table

BUCKETS = (1, 2, 4, 8, 16, 32, 64)
# Windows per captured codec call (a call of fewer pads up to the next): finer than BUCKETS, since a served level's
# joins arrive spread out and their windows meet in calls of 9–21, which BUCKETS pad to 16 or 32 (H200, served FP8 at
# 64 streams: 594 against 578 audio-s/s, means of four levels each).
CODEC_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)
# Rows one replay may decode, per batch bucket, when the scheduler allows it (nobody waiting to join, and no first
# chunk held up by the rows after the one it needs): the host's work per launch spread over several rows. A lone
# stream only, where that work is the most per row and a join waits for the fewest slots.
STEP_ROWS = {1: 4}
# Prompt lengths of the captured prefills (counts: BUCKETS), 1.5× apart past 32: a wave of joins prefills in passes of
# these shapes only (prefill_passes), so a bucket's padding is paid by every prompt of a wave (41 rows: 48, not 64).
PROMPT_BUCKETS = (16, 32, 48, 64, 96, 128, 192, 256, 384, 512)
PREFILL_PROMPTS = 4  # a prefill pass holds the rows of this many longest prompts (more when they are shorter)
# decode attention: keys per program (a row's split depends only on its own length), per block, warps
# (`higgs-trt bench attention`; the README has the figures behind the choice)
ATTENTION_CHUNK = 512
ATTENTION_BLOCK = 64
ATTENTION_WARPS = 4
# Up to this many rows decode attention sends its keys and values to L2 before its PDL wait (n × 1.2 MB a layer at
# 300 positions). H200, steps side by side: FP8 B=1 1.910 → 1.851 ms, BF16 2.644 → 2.599; at B=64, 79 MB a layer
# that L2 does not keep: 3.522 → 3.691 and 4.130 → 4.426; B=8 no gain (2.048 → 2.061).
ATTENTION_PREFETCH_ROWS = 4
# Steps (by bucket) whose decode attention loads its keys and values by TMA (bulk tensor copies): the same numbers as
# per-thread loads. H200, steps side by side (300 positions, per-thread loads → TMA at 3 stages): B=32 FP8 2.652 →
# 2.618 ms, BF16 3.392 → 3.315; slower at every other bucket (B=1 FP8 1.871 → 1.956, B=16 2.115 → 2.269, B=64 3.454
# → 3.722; at 2 stages slower still).
ATTENTION_TMA_BUCKETS = (32,)
# Steps (by bucket) whose decode attention lets the o GEMM launch as its programs finish, not as they pass their wait
# (the o GEMM's early programs then do not share the SMs with attention's). H200, steps side by side, 300 positions,
# two rounds: B=16 FP8 2.083–2.084 → 2.074–2.077 ms, BF16 2.883–2.893 → 2.842–2.852; B=32 2.527–2.528 → 2.520–2.521
# and 3.188 → 3.191–3.192; B=64 3.135–3.136 → 3.130–3.131 and 3.807–3.809 → 3.809; slower at 4 and 8 rows (FP8 1.910 →
# 1.927, 1.981 → 1.996). Letting programs past a row's prefix leave before the wait (o launches sooner) was slower at
# B=64 (3.153 → 3.162–3.170, BF16 3.846 → 3.861–3.865).
ATTENTION_LATE_LAUNCH_BUCKETS = (16, 32, 64)
PROMPT_Q_BLOCK = 64  # query rows (position × head) per prefill attention program
_claimed = threading.local()  # the engine stream each thread has made current (GpuEngine._claim_stream)


def attention_tma(k_cache: torch.Tensor, v_cache: torch.Tensor, block: int = ATTENTION_BLOCK) -> dict:
    """decode_attention_split's arguments for keys and values by TMA: descriptors of the caches [B, Hkv, S, D] as
    [rows, D] in blocks of `block` keys."""
    d = k_cache.shape[-1]
    return dict(k_desc=TensorDescriptor.from_tensor(k_cache.view(-1, d), [block, d]),
                v_desc=TensorDescriptor.from_tensor(v_cache.view(-1, d), [block, d]), TMA=True)


def bucket_table(sizes: tuple[int, ...], most: int) -> tuple[list[int], list[int]]:
    """The sizes below `most`, then `most`; and for each count 0..most the least of them that holds it."""
    buckets = [b for b in sizes if b < most] + [most]
    return buckets, [0] + [next(b for b in buckets if b >= n) for n in range(1, most + 1)]


def attention_stages(batch: int) -> int:
    """Decode attention's pipeline stages for a step of `batch` rows: 3 (96 KB of keys and values per program, two
    programs an SM) while a step's programs fit on the SMs at once, 2 past 32 rows, where more programs share an SM
    (H200, `bench attention`, 300 positions: 9.2 against 10.2 µs a layer at B=1, 32.3 against 27.4 at B=64). Stages
    change when loads are issued, not the sums: a row's numbers are the same in every bucket."""
    return 3 if batch <= 32 else 2


def slot_runs(slots: list[int]) -> list[tuple[int, int, int]]:
    """(index of its first entry, first slot, length) of each run of consecutive slots in `slots`."""
    runs = []
    for j, slot in enumerate(slots):
        if runs and slot == runs[-1][1] + runs[-1][2]:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((j, slot, 1))
    return runs


def prefill_passes(lengths: list[int], pass_rows: int, captured: dict[int, int]) -> list[int]:
    """How many of the prompts (of these lengths, in order) each prefill pass takes. `captured`: the most prompts a
    captured graph holds, per length bucket. Where a bucket holds a pass's longest prompt, passes take the graphs'
    shapes only: another shape runs eagerly, and Triton compiles variants for its row count on the request path (a
    server's first wave of 64 joins of 41 rows waited ~5 s for them on the H200). Else (longer prompts, no graphs)
    as many prompts as `pass_rows` hold, padded to the longest."""
    buckets = sorted(captured)

    def fits(count: int, longest: int) -> bool:
        bucket = next((b for b in buckets if b >= longest), None)
        return count <= captured[bucket] if bucket is not None else count * longest <= pass_rows

    passes, count, longest = [], 0, 0
    for n in lengths:
        if count and not fits(count + 1, max(longest, n)):
            passes.append(count)
            count, longest = 0, 0
        count, longest = count + 1, max(longest, n)
    return passes + [count] if count else passes


class Workspace:
    """Scratch shared by every launch of a step (they run one after another on one stream), and how they launch:
    with programmatic dependent launch (`pdl`) each kernel starts while the previous one drains and waits for its
    writes inside (plugins/kernels.await_inputs), hiding the launch gap between the step's ~300 kernels."""

    def __init__(self, max_n: int, max_batch: int, heads: int, kv_heads: int, head_dim: int, max_seq: int, device,
                 pdl: bool = False):
        self.pdl = pdl
        device = torch.device(device)
        self.sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
        chunks = -(-max_seq // ATTENTION_CHUNK)
        self.partials = torch.empty(2 * 8 * 64 * max_n, dtype=torch.float32, device=device)  # gated: two sets
        self.tickets = torch.zeros(max_n, dtype=torch.int32, device=device)
        self.attn_partials = torch.empty(max_batch, heads, chunks, head_dim, dtype=torch.float32, device=device)
        self.attn_stats = torch.empty(max_batch, heads, chunks, 2, dtype=torch.float32, device=device)
        self.attn_tickets = torch.zeros(max_batch * kv_heads, dtype=torch.int32, device=device)
        self.chunks = chunks


class Layer:
    def __init__(self, cfg: HiggsConfig, t: dict, prefix: str, amax: dict | None):
        def site(name):
            return amax[prefix + name] if amax else None

        a = prefix + "self_attn."
        self.input_norm = t[prefix + "input_layernorm.weight"]
        self.post_norm = t[prefix + "post_attention_layernorm.weight"]
        self.q_norm, self.k_norm = t[a + "q_norm.weight"], t[a + "k_norm.weight"]
        qkv = torch.cat([t[a + "q_proj.weight"], t[a + "k_proj.weight"], t[a + "v_proj.weight"]])
        self.qkv = Linear(qkv, act_amax=site("self_attn.q_proj"))
        self.o = Linear(t[a + "o_proj.weight"], act_amax=site("self_attn.o_proj"))
        m = prefix + "mlp."
        self.gate_up = Linear(t[m + "gate_proj.weight"], t[m + "up_proj.weight"], act_amax=site("mlp.gate_proj"))
        self.down = Linear(t[m + "down_proj.weight"], act_amax=site("mlp.down_proj"))


class GpuEngine:
    """Slots × (KV cache + decode state) on one CUDA device; see the module docstring."""

    name = "torch-cuda"
    lag = 1  # a step's codes are read after the next step is launched

    def __init__(self, cfg: HiggsConfig, tensors: dict, *, max_seq: int, max_batch: int, max_prompt: int,
                 act_amax: dict | None = None, codec=None, device: str = "cuda", graphs: bool = True,
                 pdl: bool | None = None):
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

        h, d, hq, hkv = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        # activation rows: the most one prefill pass holds (a decode step takes max_batch of them)
        rows = self.pass_rows = max(max_batch, PREFILL_PROMPTS * max_prompt)
        bf16 = dict(dtype=torch.bfloat16, device=dev)
        self.caches = torch.zeros(cfg.num_layers, 2, max_batch, hkv, max_seq, d, **bf16)
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
        self.prompt_start = torch.zeros(max_batch, **i64)  # a prefill's rope starts at position 0
        n_max = max(lin.n for lin in (self.layers[0].qkv, self.layers[0].gate_up, self.head))
        if pdl is None:  # Hopper on (griddepcontrol); launched without it, the kernels' waits are no-ops
            pdl = dev.type == "cuda" and torch.cuda.get_device_capability(dev) >= (9, 0)
        self.workspace = Workspace(n_max, max_batch, hq, hkv, d, max_seq, dev, pdl)

        self.stream = torch.cuda.Stream(dev) if dev.type == "cuda" else None
        self.codec_stream = torch.cuda.Stream(dev) if dev.type == "cuda" else None  # beside the decode steps
        self.buckets, self.bucket_of = bucket_table(BUCKETS, max_batch)
        self.codec_buckets, self.codec_bucket_of = bucket_table(CODEC_BUCKETS, max_batch)
        pinned = dev.type == "cuda"
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
        self.waited = 0.0  # seconds the host spent waiting for the GPU in rows() (benchmarks read these)
        self.prefill_seconds = 0.0
        self.codec_seconds: list[float] = []
        self.parity = 0
        self.graphs: dict = {}
        self.prompt_counts: dict[int, int] = {}  # length bucket → the most prompts a captured prefill graph holds
        # prefill input: the prompts padded with text token 0 to one length (causal attention keeps the padding out
        # of the prompt's rows), one after another; the keys and values go to a stage, then into their slots
        self.prompt_buckets = sorted({min(b, max_prompt) for b in PROMPT_BUCKETS})
        self.prompt_in = torch.zeros(rows, 2 + NUM_CODEBOOKS, dtype=torch.int64, device=dev)  # id, audio row, flag
        self.prompt_last = torch.zeros(max_batch, **i64)
        self.host_prompt = torch.zeros(self.prompt_in.shape, dtype=torch.int64, pin_memory=pinned)
        self.host_last = torch.zeros(max_batch, dtype=torch.int64, pin_memory=pinned)
        self.prompt_copied = torch.cuda.Event() if pinned else None
        # a starting slot's decode state, written on the host and copied up (GpuEngine._start)
        self.states = (self.write_pos, self.row_index, self.end_frame, self.active, self.temperature, self.top_k,
                       self.top_p, self.seed)
        self.host_state_tensors = [torch.zeros(max_batch, dtype=t.dtype, pin_memory=pinned) for t in self.states]
        self.host_states = [t.numpy() for t in self.host_state_tensors]
        self.states_copied = torch.cuda.Event() if pinned else None
        self.prompt_h = torch.zeros(rows, h, **bf16)
        self.stage = torch.zeros(cfg.num_layers, 2, rows * hkv * d, **bf16)
        self.codec_graphs: dict = {}  # (windows, (frames, keep)) → (graph, its codes input, its kept waveform)
        self.codec_pool = None  # the codec graphs' memory pool, shared: they run one after another on one stream
        if graphs and dev.type == "cuda":
            self._capture_all()
            if codec is not None:
                self.prepare_codec(StreamPlan.exact(self.codec_strides))

    # ---- the step ------------------------------------------------------------------------------------------------

    def _decode(self, n: int) -> None:
        """Every kernel of one decode step for slots [0, n): the work a graph replays."""
        cfg, ws = self.cfg, self.workspace
        hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        h = self.h[:n]
        for i, layer in enumerate(self.layers):
            x = self._norm(h, layer.input_norm, n, layer.qkv)
            layer.qkv(x, self.qkv_out, n, ws)
            attn = self.attn8 if layer.o.fp8 else self.attn
            tma = self.attention_tma[i] if n in ATTENTION_TMA_BUCKETS else {}
            plugin_kernels.decode_attention_split[(n, hkv, ws.chunks)](
                self.qkv_out, layer.q_norm, layer.k_norm, self.cos, self.sin, self.caches[i, 0], self.caches[i, 1],
                self.write_pos, attn, ws.attn_partials, ws.attn_stats, ws.attn_tickets, self.max_seq, cfg.rms_norm_eps,
                layer.o.x_scale, Q_HEADS=hq, KV_HEADS=hkv, HEAD_DIM=d, CHUNK=ATTENTION_CHUNK, BLOCK_S=ATTENTION_BLOCK,
                MAX_CHUNKS=ws.chunks, OUT_FP8=layer.o.fp8, num_stages=attention_stages(n),
                num_warps=ATTENTION_WARPS, PREFETCH=self.pdl and n <= ATTENTION_PREFETCH_ROWS,
                LATE_LAUNCH=n in ATTENTION_LATE_LAUNCH_BUCKETS, **tma, **self._launch())
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
        gpu_kernels.rms_norm[(rows,)](src, weight, out, self.cfg.rms_norm_eps, into.x_scale if fp8 else 1.0, H=h,
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
        plugin_kernels.delayed_codebook_sample[(n, -(-cfg.hidden_size // block_h))](
            logits, self.row_index[s], self.end_frame[s], self.table, self.temperature[s], self.top_k[s],
            self.top_p[s], self.seed[s], codes, embedding, self.end_next[s], K=cfg.num_codebooks,
            VOCAB=cfg.codebook_vocab, HIDDEN=cfg.hidden_size, BLOCK_V=1 << (cfg.codebook_vocab - 1).bit_length(),
            BLOCK_H=block_h, num_warps=8, **self._launch())

    def _advance(self, slot: int, n: int) -> None:
        s = slice(slot, slot + n)
        gpu_kernels.advance_slots[(1,)](self.write_pos[s], self.row_index[s], self.end_frame[s], self.end_next[s],
                                        self.active[s], n, self.max_seq, BLOCK=max(16, 1 << (n - 1).bit_length()),
                                        **self._launch())

    def _bucket(self, n: int) -> int:
        return self.bucket_of[n]

    def _decode_rows(self, n: int, rows: int, parity: int) -> None:
        """`rows` decode steps for slots [0, n), each step's codes copied to the parity's pinned buffer."""
        for r in range(rows):
            self._decode(n)
            self.host_codes[parity][r, :n].copy_(self.codes[:n], non_blocking=self.stream is not None)

    def _capture_all(self) -> None:
        """One graph per (bucket, parity, rows per replay), captured once: the parity picks the pinned buffer its
        codes go to."""
        with torch.cuda.stream(self.stream):
            for n in self.buckets:
                self._decode(n)  # compile and warm up outside capture
            torch.cuda.current_stream().synchronize()
            self.write_pos.zero_()
            for n in self.buckets:
                for parity in (0, 1):
                    for rows in {1, self.step_rows[n]}:
                        graph = torch.cuda.CUDAGraph()
                        with torch.cuda.graph(graph, stream=self.stream):
                            self._decode_rows(n, rows, parity)
                        self.graphs[n, parity, rows] = graph
            # a group of prompts prefills from the graph of its count and length buckets, where it fits a pass: joins
            # spread over time (a server's) come in many small groups, each ~13 ms of host time eagerly and a few ms
            # of GPU time replayed. The graphs share one pool: they run one after another on this stream.
            pool = torch.cuda.graph_pool_handle()
            for length in self.prompt_buckets:
                for count in (b for b in self.buckets if b * length <= self.pass_rows):
                    self._prefill_padded(count, length)  # warm-up (and Triton's compiles for these rows)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, stream=self.stream, pool=pool):
                        self._prefill_padded(count, length)
                    self.graphs["prompt", count, length] = graph
                    self.prompt_counts[length] = count
        self.caches.zero_()

    # ---- the scheduler's contract (runtime/scheduler.py) -----------------------------------------------------------

    @torch.inference_mode()
    def prepare_codec(self, plan: StreamPlan) -> None:
        """The codec windows of `plan` (StreamPlan.window_shapes: the first ones', the middle ones' and the last
        one's widest) as CUDA graphs, one per window count of CODEC_BUCKETS (a call of fewer windows pads up to
        the next), for shapes not captured yet: the default plan's at start-up, another plan's when a scheduler with
        it starts. A window of 18 frames is ~100 small kernels, 4 ms of launches when eager, and a call of 64
        windows of 45 frames issued eagerly kept the scheduler's loop ~12 ms from launching decode steps (the GPU
        idled behind it)."""
        if self.codec_model is None or self.codec_stream is None or not self.graphs:
            return
        shapes = set(plan.window_shapes()) - {shape for _, shape in self.codec_graphs}
        if self.codec_pool is None:
            self.codec_pool = torch.cuda.graph_pool_handle()
        with torch.cuda.stream(self.codec_stream):
            for frames, keep in sorted(shapes):
                for n in self.codec_buckets:
                    codes = torch.zeros(n, self.codec_model.dims.num_quantizers, frames, dtype=torch.int64,
                                        device=self.device)
                    self.codec_model(codes, keep)  # warm-up outside capture (cuDNN picks its algorithms)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, stream=self.codec_stream, pool=self.codec_pool):
                        wave = self.codec_model(codes, keep)
                    self.codec_graphs[n, (frames, keep)] = (graph, codes, wave)

    def _captured_codec(self, windows: int, frames: int, keep: tuple[int, int]):
        """(graph, codes, wave, the kept frames) of the captured codec call for this many windows of `frames` that
        keeps the fewest frames covering `keep` (a last window's replays the widest one's), or None."""
        bucket = self.codec_bucket_of[windows] if windows < len(self.codec_bucket_of) else None
        found = [(b - a, (a, b)) for n, (f, (a, b)) in self.codec_graphs
                 if n == bucket and f == frames and a <= keep[0] and keep[1] <= b]
        if not found:
            return None
        kept = min(found)[1]
        return (*self.codec_graphs[bucket, (frames, kept)], kept)

    @torch.inference_mode()
    def prefill(self, joins: list[tuple[int, Prompt, Sampling]]) -> None:
        """Fill each join's slot from its prompt and choose its row 0 on the device. The prompts' rows go through
        the GEMMs together (one K order for any number of rows, so a row's result does not depend on the others) and
        each row attends to its own prompt's keys: a request prefills to the same state alone or with others."""
        t0 = time.perf_counter()
        for _, prompt, _ in joins:
            if len(prompt) > self.max_prompt:
                raise ValueError(f"prompt of {len(prompt)} tokens exceeds max_prompt {self.max_prompt}")
        start = 0
        for count in prefill_passes([len(prompt) for _, prompt, _ in joins], self.pass_rows, self.prompt_counts):
            self._prefill_group(joins[start:start + count])
            start += count
        self.prefill_seconds += time.perf_counter() - t0

    def _prefill_group(self, group: list[tuple[int, Prompt, Sampling]]) -> None:
        g, longest = len(group), max(len(prompt) for _, prompt, _ in group)
        bucket = next((b for b in self.prompt_buckets if b >= longest), None)
        graph = self.graphs.get(("prompt", self.bucket_of[g], bucket))
        count, length = (self.bucket_of[g], bucket) if graph is not None else (g, longest)
        self._claim_stream()
        self._stage_prompts([prompt for _, prompt, _ in group], length, count)
        if graph is not None:
            graph.replay()
        else:
            self._prefill_padded(g, length)
        stage = self._stage_view(g, length)
        for j, slot, run in slot_runs([slot for slot, _, _ in group]):
            # the padding rows past a prompt go along: a slot's keys past its position are never read before a
            # decode step writes them (as a reused slot's keys of its previous request)
            self.caches[:, :, slot:slot + run, :, :length].copy_(stage[:, :, j:j + run])
        self._start([(slot, len(prompt), sampling) for slot, prompt, sampling in group])
        self._record("first", [slot for slot, _, _ in group])

    def _stage_prompts(self, prompts: list[Prompt], length: int, count: int) -> None:
        """Prefill input: each prompt padded with text token 0 to `length` rows, one after another, then empty
        prompts up to `count` (a graph's count bucket: their rows are computed and never read), and the index of each
        one's last row."""
        if self.prompt_copied is not None:
            self.prompt_copied.synchronize()  # the previous prefill's copies have left the pinned buffers
        host, last = self.host_prompt.numpy(), self.host_last.numpy()
        rows = count * length
        host[:rows] = 0
        last[:count] = np.arange(count) * length
        for j, prompt in enumerate(prompts):
            r, n = j * length, len(prompt)
            host[r:r + n, 0], host[r:r + n, -1] = prompt.input_ids, prompt.is_audio
            host[r:r + n, 1:-1] = prompt.audio_rows
            last[j] = r + n - 1
        self.prompt_in[:rows].copy_(self.host_prompt[:rows], non_blocking=True)
        self.prompt_last[:count].copy_(self.host_last[:count], non_blocking=True)
        if self.prompt_copied is not None:
            self.prompt_copied.record()

    def _stage_view(self, g: int, length: int) -> torch.Tensor:
        """The stage as [layer, key/value, prompt, Hkv, length, D]."""
        cfg = self.cfg
        return self.stage[:, :, :g * cfg.num_kv_heads * length * cfg.head_dim].view(
            cfg.num_layers, 2, g, cfg.num_kv_heads, length, cfg.head_dim)

    def _prefill_padded(self, g: int, length: int) -> None:
        """g staged prompts of `length` rows through every layer (rows of different prompts share each GEMM, whose K
        order does not depend on the rows, so a row's numbers depend neither on the others nor on the padding), their
        keys and values into the stage, the logits of each one's last row into logits[:g]. Captured for each count
        and length bucket that fits a pass (_capture_all)."""
        cfg, ws = self.cfg, self.workspace
        hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        p = g * length
        inp, h = self.prompt_in[:p], self.prompt_h[:p]
        qkv, q, attn, act = self.qkv_out[:p], self.q[:p], self.attn[:p], self.act[:p]
        text = F.embedding(inp[:, 0], self.text_table)
        ref = F.embedding(inp[:, 1:-1] + self.offsets, self.table).float().sum(1).to(torch.bfloat16)
        h.copy_(torch.where(inp[:, -1:] != 0, ref, text))
        stage = self._stage_view(g, length)
        heads = self.heads[:p].view(g, hq, length, d)
        for i, layer in enumerate(self.layers):
            x = self._norm(h, layer.input_norm, p, layer.qkv)
            layer.qkv(x, qkv, p, ws, prefill=True)
            k_stage, v_stage = stage[i, 0], stage[i, 1]
            plugin_kernels.qk_norm_rope_kv_write[(p,)](
                qkv, layer.q_norm, layer.k_norm, self.cos, self.sin, self.prompt_start, q, k_stage, v_stage, length,
                length, cfg.rms_norm_eps, Q_HEADS=hq, KV_HEADS=hkv, HALF=d // 2, **self._launch())
            # causal attention over each prompt's own keys only (decode_attention reads keys 0..row of each row, so a
            # row's result depends neither on the padding nor on the other prompts): q scaled as decode scales it,
            # heads first, at the graph's bf16 scale; the output goes through q's buffer (q is spent) back to rows first
            heads.copy_(q.view(g, length, hq, d).transpose(1, 2).float() * self.q_scale)
            out = q.view(g, hq, length, d)
            plugin_kernels.decode_attention[(g, hkv, -(-length * (hq // hkv) // PROMPT_Q_BLOCK))](
                heads, k_stage, v_stage, self.prompt_start, length, length, out, Q_HEADS=hq, KV_HEADS=hkv,
                HEAD_DIM=d, BLOCK_Q=PROMPT_Q_BLOCK, BLOCK_S=ATTENTION_BLOCK)
            attn.view(g, length, hq, d).copy_(out.transpose(1, 2))
            if layer.o.fp8:
                gpu_kernels.quantize_rows[(p, -(-hq * d // 1024))](attn, self.attn8, layer.o.x_scale, N=hq * d,
                                                                   BLOCK=1024, **self._launch())
            layer.o(self.attn8[:p] if layer.o.fp8 else attn, h, p, ws, residual=True, prefill=True)
            x = self._norm(h, layer.post_norm, p, layer.gate_up)
            layer.gate_up(x, act, p, ws, out_scale=layer.down.x_scale, prefill=True)
            layer.down(act, h, p, ws, residual=True, prefill=True)
        x = self._norm(h.index_select(0, self.prompt_last[:g]), self.final_norm, g)
        self.head(x, self.logits[:g], g, ws)

    def _start(self, starts: list[tuple[int, int, Sampling]]) -> None:
        """Slots whose prompts are cached start decoding: (slot, prompt rows, sampling) of the j-th prompt of the pass
        just run, its row 0 chosen from logits[j]. The states go up from pinned buffers, and a run of consecutive slots
        (a wave of joins takes consecutive slots) is one copy per state and one codebook launch: per slot, the
        launches cost ~0.5 ms of host time on the H200's host, 30 ms for 64 joins."""
        cfg = self.cfg
        if self.states_copied is not None:
            self.states_copied.synchronize()  # the previous start's copies have left the pinned buffers
        for slot, n, sampling in starts:
            values = (n - 1,  # advance_slots moves it to n, where row 0 is fed back
                      0, int(NO_END), 1, max(sampling.temperature, 0.0),
                      min(sampling.top_k, cfg.codebook_vocab),  # ≥ the vocabulary: every code
                      sampling.top_p, sampling.seed)
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
        (the thread that drives an engine runs on its stream). Once per thread and engine: `with
        torch.cuda.stream(...)` around each step cost 9 µs of host time on the H200's host, more than the step's
        graph launch (6.6 µs)."""
        if self.stream is not None and getattr(_claimed, "stream", None) is not self.stream:
            torch.cuda.set_stream(self.stream)
            _claimed.stream = self.stream

    def step(self, n: int, rows: int = 1) -> int:
        """One row, or `rows` where the bucket replays that many (STEP_ROWS), for every active slot below n
        (inactive ones compute rows nobody reads); returns how many."""
        n = self._bucket(n)
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

    def release(self, slot: int) -> None:
        self.live[slot] = False
        self._claim_stream()
        self.active[slot:slot + 1].fill_(0)

    @torch.inference_mode()
    def codec(self, codes: np.ndarray, keep: tuple[int, int] | None = None) -> "PendingAudio | Decoded":
        """Codec windows decoded on the codec stream while decode steps go on in the engine stream (the scheduler
        collects the audio when it is ready): at 64 streams a call of 64 windows takes as long as about 5 steps.
        Only the samples that frames `keep` depend on are computed (CodecDecoder's keep)."""
        t0 = time.perf_counter()
        windows, frames = codes.shape[0], codes.shape[-1]
        keep = keep or (0, frames)
        if self.codec_stream is None:
            audio = Decoded(self.codec_model(torch.from_numpy(codes), keep).numpy())
        else:
            # pinned, so that neither copy waits for the codec stream's earlier calls
            codes = torch.from_numpy(codes).pin_memory()
            with torch.cuda.stream(self.codec_stream):
                captured = self._captured_codec(windows, frames, keep)
                if captured is not None:
                    graph, inputs, wave, kept = captured
                    inputs[:windows].copy_(codes, non_blocking=True)
                    inputs[windows:].zero_()  # padding windows: their audio is not read
                    graph.replay()
                    hop = self.codec_model.dims.hop
                    wave = wave[:windows, :, (keep[0] - kept[0]) * hop:(keep[1] - kept[0]) * hop]
                else:
                    wave = self.codec_model(codes.to(self.device, non_blocking=True), keep)
                host = torch.empty(wave.shape, dtype=wave.dtype, pin_memory=True)
                host.copy_(wave, non_blocking=True)
                done = torch.cuda.Event()
                done.record(self.codec_stream)
            audio = PendingAudio(self, done, host)
        self.codec_seconds.append(time.perf_counter() - t0)
        del self.codec_seconds[:-64]
        return audio


class PendingAudio:
    """A codec call in flight on the GPU: ready() without waiting, result() waits (counted in engine.waited)."""

    def __init__(self, engine: GpuEngine, done: "torch.cuda.Event", host: torch.Tensor):
        self.engine, self.done, self.host = engine, done, host

    def ready(self) -> bool:
        return self.done.query()

    def result(self) -> np.ndarray:
        t0 = time.perf_counter()
        self.done.synchronize()
        self.engine.waited += time.perf_counter() - t0
        return self.host.numpy()


def load_gpu_engine(source, *, max_seq: int, max_batch: int, max_prompt: int, act_amax: dict | None = None,
                    codec_fp16: bool = True, say=lambda msg: None) -> GpuEngine:
    """A GpuEngine from a Checkpoint or an EngineWeights (an engine directory's weights.bin): the language model's
    tensors by their checkpoint names, the codec decoder on the same device (its convolutions in fp16 unless
    `codec_fp16` is off: TF32 then; CodecDecoder.fp16)."""
    from .codec import CodecDecoder
    from .model import HiggsLM

    extras.require_cuda("the GPU engine")
    cfg = source.config
    tensors = source.take(HiggsLM.expected_tensors(cfg), "language model")
    codec = CodecDecoder.from_checkpoint(source).channels_last().to("cuda")
    if codec_fp16:
        codec.fp16()
    say(f"  capturing decode graphs for batches {', '.join(map(str, bucket_table(BUCKETS, max_batch)[0]))}…")
    return GpuEngine(cfg, tensors, max_seq=max_seq, max_batch=max_batch, max_prompt=max_prompt, act_amax=act_amax,
                     codec=codec)
