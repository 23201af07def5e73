"""Build-time accuracy gate: FP8 against BF16 on held-out prompts, teacher-forced, before an FP8 build is accepted.

ONNX Runtime runs the two fp32 twins (lm.ref.onnx and lm.fp8.ref.onnx): they differ only by the FP8
quantization, which ORT emulates exactly. The BF16 twin decodes greedily; both graphs are fed its rows, and each
step's logits are compared: cosine over the 8×1026 logits, and per-codebook top-1 agreement (codebooks still in
their ramp-up are not counted). Below either floor the build is refused, naming the site whose GEMM loses most
to quantization on the same prompts (torch reference, fake-quantized, one GEMM at a time).

Random weights are not real activations: the floors are parameters, defaults set from measurements on random
checkpoints (docs/fp8.md).
"""

from dataclasses import asdict, dataclass

import numpy as np

from higgs_trt.runtime.errors import HiggsError
from higgs_trt.runtime.generate import NO_END, prefill_feeds, step_feeds

# Below what random checkpoints reach with either statistic (`bench build`, docs/fp8.md), far above what badly
# scaled FP8 gives: the floors leave room for the spread and refuse clearly broken builds.
DEFAULT_COSINE = 0.98
DEFAULT_TOP1 = 0.95


@dataclass
class GateFigures:
    cosine_mean: float
    cosine_min: float
    top1: float
    top1_per_codebook: list
    steps: int
    worst_site: str = ""
    worst_site_error: float = 0.0

    def line(self) -> str:
        cbs = " ".join(f"{a:.2f}" for a in self.top1_per_codebook)
        return (f"FP8 vs BF16 over {self.steps} teacher-forced steps: logits cosine mean {self.cosine_mean:.5f} "
                f"min {self.cosine_min:.5f}; top-1 agreement {self.top1:.3f} (per codebook {cbs})")


def teacher_forced(engine, prompts, rows: int) -> GateFigures:
    from higgs_trt.runtime.backends.ort import OrtBackend

    bf16, fp8 = OrtBackend(engine, graph="lm_ref", max_batch=1), OrtBackend(engine, graph="lm_fp8_ref", max_batch=1)
    cosines, agree = [], []
    for prompt in prompts:
        feeds = prefill_feeds([prompt])
        position = len(prompt)
        for row in range(min(rows, bf16.max_seq - position)):
            outs = []
            for backend in (bf16, fp8):
                logits, codes = backend.lm(feeds, slot=0)
                outs.append((logits[0].astype(np.float64), codes.copy()))
            (a, codes), (b, _) = outs
            cosines.append(float((a * b).sum() / np.sqrt((a * a).sum() * (b * b).sum())))
            active = np.arange(a.shape[0]) <= row
            agree.append(np.where(active, a.argmax(-1) == b.argmax(-1), np.nan))
            feeds = step_feeds(codes, np.array([position + row]), row + 1, np.array([NO_END]))
    agree = np.array(agree)
    return GateFigures(float(np.mean(cosines)), float(np.min(cosines)), float(np.nanmean(agree)),
                       [round(float(x), 4) for x in np.nanmean(agree, axis=0)], len(cosines))


def site_errors(reference, amax: dict[str, float]) -> dict[str, float]:
    """Per site: ‖Q(x)Q(W)ᵀ − xWᵀ‖ / ‖xWᵀ‖ over the held-out prompts (each GEMM quantized alone)."""
    import torch

    from higgs_trt.plugins.fp8 import bf16_scale, fake_quantize_weight

    from .calibrate import observe

    sums: dict[str, list] = {}
    weights: dict[str, torch.Tensor] = {}

    def visit(site, module, x):
        if site not in weights:
            weights[site] = fake_quantize_weight(module.weight)
        x = x.float()
        scale = bf16_scale(amax[site])
        xq = (x / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale
        exact = x @ module.weight.float().T
        err = xq @ weights[site].T - exact
        s = sums.setdefault(site, [0.0, 0.0])
        s[0] += float((err * err).sum())
        s[1] += float((exact * exact).sum())

    observe(reference, visit, split="heldout")
    return {site: (e / max(r, 1e-30)) ** 0.5 for site, (e, r) in sums.items()}


def run_gate(engine, reference, calibration: dict, cosine_floor: float, top1_floor: float, say) -> dict:
    """The gate's figures for an engine directory's FP8 graphs; `reference`: the checkpoint's BF16 torch reference
    (observe), whose GEMMs name the worst site."""
    from higgs_trt.runtime.prompt import HiggsTokenizer

    from .calibrate import build_prompts, prompt_set

    prompts = prompt_set()
    held_out = build_prompts(HiggsTokenizer(engine.path / "tokenizer.json"), prompts["heldout"])
    figures = teacher_forced(engine, held_out, prompts["rows"])
    errors = site_errors(reference, calibration["activation_amax"])
    figures.worst_site, figures.worst_site_error = max(errors.items(), key=lambda kv: kv[1])
    say(f"  {figures.line()}")
    say(f"  largest single-GEMM FP8 error: {figures.worst_site} ({100 * figures.worst_site_error:.2f}%)")
    if figures.cosine_min < cosine_floor or figures.top1 < top1_floor:
        raise HiggsError(f"FP8 build refused by the accuracy gate: cosine min {figures.cosine_min:.4f} "
                         f"(floor {cosine_floor}), top-1 agreement {figures.top1:.3f} (floor {top1_floor}); "
                         f"worst site {figures.worst_site} ({100 * figures.worst_site_error:.2f}% error)")
    return {**asdict(figures), "cosine_floor": cosine_floor, "top1_floor": top1_floor}
