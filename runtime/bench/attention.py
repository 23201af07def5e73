"""`bench attention`: the GPU engine's decode attention at Higgs v3's heads, its chunk, key block, pipeline stages,
warps and loads timed against each other (needs a GPU)."""

import torch

from higgs_trt.runtime.config import HiggsConfig
from higgs_trt.runtime.gpu.launches import ATTENTION_BLOCK, ATTENTION_CHUNK, attention_tma

from .kernels import copy_bandwidth, graph_ms


def sweep_attention(cfg: HiggsConfig, batches=(1, 8, 64), contexts=(300, 1000), max_seq: int = 2048,
                    say=print) -> None:
    """decode_attention_split's chunk, key block, pipeline stages and warps, timed at each batch and context (µs per layer;
    every slot at `context` cached positions, four layers' caches in turn so that none is in L2), against the bytes of
    keys and values read at the copy bandwidth."""
    from higgs_trt.plugins import attention
    from higgs_trt.plugins.rope_table import rope_table

    hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    bandwidth = copy_bandwidth()
    b_max = max(batches)
    caches = [torch.randn(2, b_max, hkv, max_seq, d, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
    tma_descriptors = [attention_tma(kv[0], kv[1]) for kv in caches]
    qkv = torch.randn(b_max, (hq + 2 * hkv) * d, device="cuda", dtype=torch.bfloat16)
    norm = torch.ones(d, device="cuda", dtype=torch.bfloat16)
    cos, sin = (t.cuda() for t in rope_table(cfg, max_seq, torch.bfloat16))
    out = torch.empty(b_max, hq * d, device="cuda", dtype=torch.bfloat16)
    pos = torch.zeros(b_max, dtype=torch.int64, device="cuda")
    variants = [(chunk, block, stages, warps, False) for chunk in (256, 512) for block in (32, 64, 128)
                for stages in (2, 3) for warps in (4, 8)]
    # today's chunk and block with keys and values by TMA (ATTENTION_TMA_BUCKETS)
    variants += [(ATTENTION_CHUNK, ATTENTION_BLOCK, stages, 4, True) for stages in (2, 3)]
    say("decode attention, µs per layer (× the copy rate's time for its keys and values) at "
        + ", ".join(f"B={b} S={c}" for b in batches for c in contexts))
    for chunk, block, stages, warps, tma in variants:
        chunks = -(-max_seq // chunk)
        partials = torch.empty(b_max, hq, chunks, d, device="cuda")
        stats = torch.empty(b_max, hq, chunks, 2, device="cuda")
        tickets = torch.zeros(b_max * hkv, dtype=torch.int32, device="cuda")
        figures = []
        for b in batches:
            for context in contexts:
                pos.fill_(context - 1)

                def run():
                    for kv, descriptors in zip(caches, tma_descriptors if tma else [{}] * len(caches)):
                        attention.decode_attention_split[(b, hkv, chunks)](
                            qkv, norm, norm, cos, sin, kv[0], kv[1], pos, out, partials, stats, tickets, max_seq,
                            cfg.rms_norm_eps, 1.0, Q_HEADS=hq, KV_HEADS=hkv, HEAD_DIM=d, CHUNK=chunk, BLOCK_S=block,
                            MAX_CHUNKS=chunks, num_stages=stages, num_warps=warps, **descriptors)
                try:
                    us = graph_ms(run) / len(caches) * 1e3
                except Exception as e:  # shared memory, registers
                    figures.append(type(e).__name__)
                    continue
                floor_us = 2 * b * hkv * context * d * 2 / bandwidth * 1e6
                figures.append(f"{us:6.1f} ({us / floor_us:3.1f}×)")
        say(f"  chunk {chunk:<4} block {block:<3} stages {stages} warps {warps}{' TMA' if tma else '    '}: "
            f"{'  '.join(figures)}")
