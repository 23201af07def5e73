"""How the GPU engine's launches are shaped: the batch and prompt buckets its CUDA graphs are captured for, how a wave
of joins splits into prefill passes, decode attention's tuning per bucket, and the scratch every launch of a step
shares. Bucket and tuning choices are measured with `higgs-trt bench decode`, `bench attention` and `bench linear`;
none of them changes a row's numbers (the kernels are batch invariant), only when and how they are computed."""

import torch
from triton.tools.tensor_descriptor import TensorDescriptor

# Decode steps' batch buckets (the slots below n are stepped as the bucket above n; a step's inactive slots cost their
# GEMM rows, not attention). Past 64 the tiles and attention settings are 64's, not tuned (docs/gpu-engine.md).
BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
# Windows per captured codec call (a call of fewer pads up to the next, one of more goes in pieces of the largest):
# finer than BUCKETS, since a served level's joins arrive spread out and their windows meet in calls of 9–21 that
# BUCKETS would pad to 16 or 32; no more than 64, the largest call whose memory has been measured.
CODEC_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)
# Rows one replay may decode, per batch bucket, when the scheduler allows it (nobody waiting to join, and no first
# chunk held up by the rows after the one it needs): the host's work per launch spread over several rows. A lone
# stream only, where that work is the most per row and a join waits for the fewest slots.
STEP_ROWS = {1: 4}
# Prompt lengths of the captured prefills (counts: BUCKETS), 1.5× apart past 32: a wave of joins prefills in passes of
# these shapes only (prefill_passes), so a bucket's padding is paid by every prompt of a wave.
PROMPT_BUCKETS = (16, 32, 48, 64, 96, 128, 192, 256, 384, 512)
PREFILL_PROMPTS = 4  # a prefill pass holds the rows of this many longest prompts (more when they are shorter)
# decode attention: keys per program (a row's split depends only on its own length), per block, warps
ATTENTION_CHUNK = 512
ATTENTION_BLOCK = 64
ATTENTION_WARPS = 4
# Up to this many rows decode attention sends its keys and values to L2 before its PDL wait; for more rows L2 cannot
# keep them and the prefetch only adds traffic.
ATTENTION_PREFETCH_ROWS = 4
# Steps (by bucket) whose decode attention loads its keys and values by TMA (bulk tensor copies): the same numbers as
# per-thread loads, faster only at this bucket.
ATTENTION_TMA_BUCKETS = (32,)
# Steps (by bucket) whose decode attention lets the o GEMM launch as its programs finish, not as they pass their wait
# (the o GEMM's early programs then do not share the SMs with attention's): faster from 16 rows, slower below (past 64
# as at 64, not measured).
ATTENTION_LATE_LAUNCH_BUCKETS = (16, 32, 64, 128, 256, 512)
PROMPT_Q_BLOCK = 64  # query rows (position × head) per prefill attention program


def attention_tma(k_cache: torch.Tensor, v_cache: torch.Tensor, block: int = ATTENTION_BLOCK) -> dict:
    """decode_attention_split's arguments for keys and values by TMA: descriptors of the caches (the engine's pool
    [pages, Hkv, page, D], or [B, Hkv, S, D]) as [rows, D] in blocks of `block` keys."""
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
    (`bench attention`). Stages change when loads are issued, not the sums: a row's numbers are the same in every
    bucket."""
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
    shapes only: another shape runs eagerly, and Triton would compile variants for its row count on the request path,
    seconds in which every stream waits. Else (longer prompts, no graphs) as many prompts as `pass_rows` hold, padded
    to the longest."""
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
    writes inside (plugins/primitives.await_inputs), hiding the launch gap between the step's ~300 kernels."""

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
