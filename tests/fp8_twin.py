"""ONNX Runtime's run of an engine directory's reference twin (lm_fp8_bf16ref: the FP8 graph with its bf16 roundings;
lm_fp8_ref: the FP8 Q/DQ graph in fp32; lm_ref: the bf16 graph in fp32), greedy or fed given rows: what the GPU
engine in FP8 is held to, teacher-forced. Shared by the interpreter test on the tiny checkpoint
(tests/test_gpu_kernels.py, in its child process) and the H200 one on the mid checkpoint (tests/test_gpu_engine.py)."""

import numpy as np
import torch

from higgs_trt.runtime.backends.ort import OrtBackend
from higgs_trt.runtime.decoding import NO_END, delay_mask
from higgs_trt.runtime.generate import prefill_feeds, step_feeds


def twin_logits(engine, prompt, steps: int, graph: str = "lm_fp8_ref", fed=None):
    """(logits [steps + 1, 8·audio vocab] fp32: the prompt's row, then one per fed row; the rows fed): greedy rows of
    the twin itself, or `fed`."""
    twin = OrtBackend(engine, max_batch=1, graph=graph)
    logits, codes = twin.lm(prefill_feeds([prompt]), slot=0)
    out, rows = [logits[0].reshape(8, -1)], []
    for r in range(steps):
        row = delay_mask(codes.reshape(1, 8), np.array([r]), np.array([NO_END])) if fed is None else fed[r][None]
        rows.append(row[0])
        logits, codes = twin.lm(step_feeds(row, [len(prompt) + r], r + 1, [NO_END]))
        out.append(logits[0].reshape(8, -1))
    return torch.from_numpy(np.stack(out)).float().flatten(1), rows
