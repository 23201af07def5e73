"""`compare`: torch, ONNX Runtime and TensorRT on the same teacher-forced decode steps (Polygraphy)."""

from pathlib import Path

import click

from higgs_trt.runtime import extras
from higgs_trt.runtime.errors import HiggsError

from .build import open_checkpoint
from .options import say
from .paths import PATH

PROMPT_KEYS = ("text", "ref_text", "ref_codes")


SAVED = ("inputs.json", "outputs.json", "report.json")


def read_prompts_file(path: Path) -> list[dict]:
    """compare --prompts: a JSON list of {"text", optional "ref_text", "ref_codes" [T,8]}, every field checked."""
    from higgs_trt.runtime.jsonfile import read_json
    from higgs_trt.runtime.prompt import check_reference_codes, check_text

    items = read_json(path)
    if not isinstance(items, list) or not items:
        raise HiggsError(f'{path}: expected a non-empty JSON list of {{"text": ...}} objects')
    for i, item in enumerate(items):
        where = f"{path}: prompt {i}"
        if not isinstance(item, dict) or "text" not in item:
            raise HiggsError(f'{where} is not a {{"text": ...}} object')
        unknown = sorted(set(item) - set(PROMPT_KEYS))
        if unknown:
            raise HiggsError(f"{where} has unknown key(s) {', '.join(map(repr, unknown))} (known: {', '.join(PROMPT_KEYS)})")
        check_text(item["text"], f"{where} text")
        if "ref_text" in item:
            if "ref_codes" not in item:
                raise HiggsError(f"{where} has ref_text without ref_codes")
            check_text(item["ref_text"], f"{where} ref_text")
        if "ref_codes" in item:
            check_reference_codes(item["ref_codes"], where)
    return items


def check_runners(runners: str) -> list[str]:
    names = [r.strip() for r in runners.split(",") if r.strip()]
    unknown = [r for r in names if r not in ("torch", "ort", "trt")]
    if unknown:
        raise HiggsError(f"unknown runner {unknown[0]!r}; choose from torch, ort, trt")
    if len(set(names)) != len(names) or len(names) < 2:
        raise HiggsError(f"--runners needs at least two runners, each named once, got {runners!r}")
    return names


def _not_a_compare_save(directory: Path) -> str | None:
    from higgs_trt.runtime.outputs import unexpected_entries

    others = unexpected_entries(directory, lambda name: name in SAVED)
    return f"holds files compare --save does not write ({', '.join(sorted(others)[:5])})" if others else None


@click.command()
@click.option("--engine", type=PATH, required=True, help="Engine directory.")
@click.option("--checkpoint", type=PATH,
              help="The engine's checkpoint (for the torch runner; checked against the manifest).")
@click.option("--runners", default="torch,ort,trt", show_default=True,
              help="Comma-separated, the first is the reference; trt is skipped where TensorRT is not usable.")
@click.option("--prompts", type=PATH,
              help='JSON list of {"text": ..., optional "ref_text", "ref_codes"} '
                   '[default: the built-in held-out prompts].')
@click.option("--steps", type=int, default=32, show_default=True, help="Teacher-forced decode steps per prompt.")
@click.option("--save", type=PATH,
              help="Write inputs.json / outputs.json (Polygraphy's format) and report.json into this directory "
                   "(new, empty, or one an earlier --save wrote).")
@click.option("--per-layer", is_flag=True,
              help="Also mark every intermediate tensor of the engine's fp32 twin and name the first one that differs "
                   "from a fresh export of --checkpoint (locates a broken layer).")
def compare(engine, checkpoint, runners, prompts, steps, save, per_layer):
    """Compare torch, ONNX Runtime and TensorRT on the same teacher-forced decode steps (Polygraphy)."""
    from contextlib import nullcontext

    from higgs_trt.runtime.manifest import EngineDir
    from higgs_trt.runtime.options import within
    from higgs_trt.runtime.outputs import output_dir, staged_dir

    from .engines import Sources, check_prompt_fits, load_tokenizer

    runner_names = check_runners(runners)
    if per_layer and checkpoint is None:
        raise HiggsError("--per-layer needs --checkpoint")
    if save is not None:
        save = output_dir(save, "a compare --save directory", _not_a_compare_save, inputs=(engine, checkpoint, prompts))
    items = read_prompts_file(prompts) if prompts is not None else None
    engine_dir = EngineDir(engine)
    within("--steps", steps, 1, engine_dir.manifest["limits"]["max_seq"], "the engine's max-seq")
    with extras.needed("compare", "compare"):
        from higgs_trt.builder.compare import compare as run_compare
        from higgs_trt.builder.compare import summary
        from higgs_trt.calibration.calibrate import build_prompts, prompt_set
    tok = load_tokenizer(Sources("ort", engine_dir, None))
    prompt_list = []
    for i, p in enumerate(items or prompt_set()["heldout"]):
        try:
            prompt = build_prompts(tok, [p])[0]
            check_prompt_fits(prompt, engine_dir)
        except HiggsError as e:
            raise HiggsError(f"{prompts or 'built-in prompts'}: prompt {i}: {e}") from None
        prompt_list.append(prompt)
    ckpt = open_checkpoint(checkpoint, "compare") if checkpoint is not None else None
    with staged_dir(save) if save is not None else nullcontext() as staging:
        report = run_compare(engine, ckpt, runner_names, prompt_list, steps, staging, say)
    for line in summary(report):
        click.echo(line)
    if per_layer:
        from higgs_trt.builder.compare import locate_divergence

        first = locate_divergence(engine, ckpt, prompt_list, say)
        click.echo(f"per-layer: {first['compared']} tensors compared; "
                   + (f"first to differ: {first['tensor']} (max |Δ| {first['max_abs']:.3g})" if first["tensor"]
                      else "all agree"))
    if not report["passed"]:
        raise click.exceptions.Exit(1)
