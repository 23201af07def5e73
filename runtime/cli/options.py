"""Option groups shared by several commands, each declared once, and the helpers every command uses."""

import click

from .paths import PATH

MAX_SEQ_HELP = "KV-cache length (torch backend from a checkpoint) [default: 2048, or the model's positions if fewer]."
PRECISION_HELP = ("With --engine: refuse an engine of another precision. With --checkpoint on a GPU (torch): bf16 "
                  "(default), or fp8 with scales calibrated at start-up on the built-in prompt set.")


def say(msg: str) -> None:
    """Progress and figures a person reads: on stderr, so stdout stays the command's output (raw PCM, say)."""
    click.echo(msg, err=True)


def given(ctx: click.Context) -> set[str]:
    """The options the user set (on the command line or through the environment), not left at their defaults."""
    return {k for k in ctx.params if ctx.get_parameter_source(k) not in (None, click.core.ParameterSource.DEFAULT)}


def options(*decorators):
    """One decorator applying `decorators` in the order listed (the first is the first option in --help)."""
    def apply(command):
        for decorator in reversed(decorators):
            command = decorator(command)
        return command

    return apply


engine_source = options(
    click.option("--engine", type=PATH, help="Engine directory made by `higgs-trt export` or `build`."),
    click.option("--checkpoint", type=PATH,
                 help="Checkpoint directory (torch backend); with --engine, checked to be the engine's source."),
    click.option("--backend", type=click.Choice(["torch", "ort", "trt"]),
                 help="torch: the GPU engine (--engine's weights or --checkpoint), or the fp32 reference on the CPU; "
                      "ort: ONNX Runtime on --engine's reference graphs (CPU); trt: TensorRT on --engine's plans. "
                      "Default: ort with --engine, else torch."),
    click.option("--device", type=click.Choice(["auto", "cpu", "cuda", "lean"]), default="auto", show_default=True,
                 help="torch: cuda runs the GPU engine, cpu the fp32 reference (auto: cuda when torch sees a GPU); "
                      "trt: lean loads --lean plans with tensorrt_lean."),
)

precision_option = click.option("--precision", type=click.Choice(["bf16", "fp8"]), help=PRECISION_HELP)

codec_precision_option = click.option(
    "--codec-precision", type=click.Choice(["fp16", "tf32"]),
    help="The GPU engine's codec convolutions: fp16 (default; fp32 sums, ~1.5× faster calls at 64 windows) or tf32 "
         "(what the model notes recommend for the real codec: its transposed convolutions in low precision).")

max_seq_option = click.option("--max-seq", type=int, help=MAX_SEQ_HELP)

stream_plan_options = options(
    click.option("--first-chunk", type=int, default=8, show_default=True,
                 help="Frames (40 ms each) in the first chunk; fewer start the audio sooner, seams still exact."),
    click.option("--chunk", type=int, default=25, show_default=True,
                 help="Frames in each later chunk; after a smaller first chunk they grow to it, each at most 4× the "
                      "audio sent before it (2, 8, 25)."),
    click.option("--context", type=int, help="Frames decoded before each chunk [default: the codec's receptive field]."),
    click.option("--holdback", type=int, help="Frames decoded after each chunk [default: the codec's receptive field]."),
    click.option("--first-holdback", type=int, help="Low latency: a smaller holdback for the first chunk only (its last "
                 "samples are then not exact)."),
)


def stream_plan(first_chunk: int, chunk: int, context: int | None, holdback: int | None, first_holdback: int | None,
                strides=(8, 5, 4, 2, 3), warn: bool = False):
    """Codec windows: exact by default (context and holdback from the decoder's receptive field)."""
    from higgs_trt.runtime.streaming import StreamPlan, receptive_field

    left, right = receptive_field(tuple(strides))
    plan = StreamPlan(left if context is None else context, right if holdback is None else holdback, first_chunk,
                      chunk, first_holdback)
    short = plan.left < left or plan.right < right or plan.first_right is not None and plan.first_right < right
    if warn and short:
        say(f"note: context {plan.left} / holdback {plan.right}"
            + (f" / first holdback {plan.first_right}" if plan.first_right is not None else "")
            + f" frames is less than the codec's receptive field ({left} / {right}): chunk seams are not exact")
    return plan

