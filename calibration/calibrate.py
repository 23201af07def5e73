"""FP8 activation scales from the fixed, built-in prompt set, through the BF16 torch reference.

Every GEMM input of the decoder layers (q/k/v, o, gate/up, down) is observed with a forward pre-hook while each
calibration prompt is prefilled and then decoded greedily for a fixed number of rows: scales cover the decode
path, not only the prompt. The statistic per site is the 99.9th percentile of the per-token max |x| (`p999`, the
default) or the largest (`max`): on random checkpoints p999 gives the better FP8 gate figures (`bench build`).
Real activations may have outlier channels that clipping hurts; `max` keeps them.

ModelOpt is not used here: its torch calibration instruments nn.Linear (our Linear exports as Gemm on the
checkpoint's own tensor), its ONNX calibration only sees the inputs it is fed (not our decode loop), and its Q/DQ
placement adds residual/norm/attention quantizers the card keeps in bf16. A forward hook and a reduction over the
observed per-token maxima are the whole job.

The result, calibration.json, names the prompt-set version and hash and the checkpoint it belongs to, and is
sealed with a hash of its content; the same inputs give the same bytes.
"""

import hashlib
import json
from pathlib import Path

import numpy as np

from higgs_trt.runtime.errors import HiggsError

PROMPTS = Path(__file__).with_name("prompts.json")
FORMAT = 1
QUANTIZED = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
             "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
STATISTICS = ("max", "p999")


def prompt_set() -> dict:
    raw = PROMPTS.read_bytes()
    return {**json.loads(raw), "sha256": hashlib.sha256(raw).hexdigest()}


def quantized_sites(num_layers: int) -> list[str]:
    return [f"body.layers.{i}.{s}" for i in range(num_layers) for s in QUANTIZED]


def _seal(body: dict) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def build_prompts(tok, items: list[dict]):
    from higgs_trt.runtime.prompt import build_prompt

    return [build_prompt(tok, p["text"], np.array(p["ref_codes"], np.int32) if "ref_codes" in p else None,
                         p.get("ref_text")) for p in items]


def observe(reference, visit, split: str = "calibration") -> None:
    """Call visit(site, module, x) with the input x of every quantized GEMM while the prompt set's `split` is
    prefilled and decoded greedily by `reference`, the BF16 torch reference of a checkpoint
    (builder/torch_backend.bf16_reference), one prompt at a time: no padding rows."""
    from higgs_trt.runtime.decoding import Sampling
    from higgs_trt.runtime.generate import generate
    from higgs_trt.runtime.prompt import HiggsTokenizer
    from higgs_trt.runtime.stepper import HostStepper

    prompts = prompt_set()
    tok = HiggsTokenizer(reference.checkpoint.dir / "tokenizer.json")
    hooks = [module.register_forward_pre_hook(lambda m, args, name=name: visit(name, m, args[0].detach()))
             for name, module in reference.model.named_modules() if name.endswith(QUANTIZED)]
    try:
        for prompt in build_prompts(tok, prompts[split]):
            generate(HostStepper(reference), [prompt], Sampling(), hard_cap=prompts["rows"])
    finally:
        for h in hooks:
            h.remove()


def calibrate(reference, statistic: str = "p999") -> dict:
    """Activation scales of `reference`'s checkpoint (observe), sealed (module docstring)."""
    if statistic not in STATISTICS:
        raise HiggsError(f"unknown statistic {statistic!r}; choose {', '.join(STATISTICS)}")
    ckpt = reference.checkpoint
    seen: dict[str, list] = {}
    observe(reference, lambda site, _, x: seen.setdefault(site, []).append(
        x.abs().amax(dim=-1).float().flatten().cpu().numpy()))
    per_token = {site: np.concatenate(v) for site, v in sorted(seen.items())}
    reduce = np.max if statistic == "max" else (lambda v: np.percentile(v, 99.9))
    prompts = prompt_set()
    body = {
        "format": FORMAT,
        "prompt_set": {"version": prompts["version"], "sha256": prompts["sha256"]},
        "checkpoint": ckpt.fingerprint(),
        "statistic": statistic,
        "rows": prompts["rows"],
        "tokens": int(len(next(iter(per_token.values())))),
        "activation_amax": {name: float(np.float32(reduce(v))) for name, v in per_token.items()},
    }
    missing = set(quantized_sites(ckpt.config.num_layers)) - set(body["activation_amax"])
    if missing:
        raise RuntimeError(f"calibration saw no input at {sorted(missing)[:3]}")
    return {**body, "content_sha256": _seal(body)}


def write_calibration(calibration: dict, path: Path) -> None:
    Path(path).write_text(json.dumps(calibration, indent=1, sort_keys=True) + "\n")


def load_calibration(path: Path, fingerprint: str) -> dict:
    """A calibration file, refused unless it is intact and belongs to this checkpoint and prompt-set version."""
    from higgs_trt.runtime.jsonfile import read_json

    calibration = read_json(path)
    body = {k: v for k, v in calibration.items() if k != "content_sha256"} if isinstance(calibration, dict) else {}
    if not body or calibration.get("format") != FORMAT or calibration.get("content_sha256") != _seal(body):
        raise HiggsError(f"{path}: not an intact calibration file (edited, truncated or another format)")
    amax = calibration.get("activation_amax")
    if not (isinstance(calibration.get("prompt_set"), dict) and isinstance(calibration.get("checkpoint"), str)
            and isinstance(amax, dict) and amax
            and all(type(v) in (int, float) and 0 < v < float("inf") for v in amax.values())):
        raise HiggsError(f"{path}: not a calibration file of this tool (no prompt set, checkpoint or positive "
                         "activation ranges)")
    current = prompt_set()
    if calibration["prompt_set"] != {"version": current["version"], "sha256": current["sha256"]}:
        raise HiggsError(f"{path}: calibrated on prompt set v{calibration['prompt_set'].get('version')}, this tool's "
                         f"is v{current['version']}; run `higgs-trt calibrate` again")
    if calibration["checkpoint"] != fingerprint:
        raise HiggsError(f"{path}: calibrated for another checkpoint (fingerprint {calibration['checkpoint'][:12]}…)")
    return calibration
