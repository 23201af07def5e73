"""`higgs-trt`: the command line, one click group. The commands live one concern a module (run, serve, build,
compare, doctor, bench); each imports its heavy dependencies (torch, onnx, TensorRT, Starlette) when it runs, so
`--help` and the lean deploy path start without them."""

import click

from higgs_trt.runtime.errors import HiggsError
from higgs_trt.runtime.outputs import remember_interrupts

from . import bench, build, compare, doctor, run, serve


class Cli(click.Group):
    """Turns HiggsError into a one-line `Error: ...` and exit code 1, never a traceback."""

    def invoke(self, ctx):
        remember_interrupts()
        try:
            return super().invoke(ctx)
        except HiggsError as e:
            raise click.ClickException(str(e)) from None
        except OSError as e:  # a file the checks passed that vanished or changed while the command ran
            if e.filename is None:
                raise
            raise click.ClickException(f"{e.filename}: {e.strerror or e}") from None


@click.group(cls=Cli, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(package_name="higgs-trt")
def main():
    """Higgs Audio v3 text-to-speech on TensorRT: export, build, run and compare."""


for command in (run.run, run.encode_audio, serve.serve, *build.COMMANDS, compare.compare, doctor.doctor, bench.bench):
    main.add_command(command)
