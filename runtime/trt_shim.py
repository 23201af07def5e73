"""One code path over the TensorRT family.

- `tensorrt`: datacenter TensorRT (10.15+ / 11): builds for the local GPU and runs plans.
- `rtx` (`tensorrt_rtx_bindings`): TensorRT-RTX: parses ONNX and builds real plans on a machine without a GPU for
  a named compute capability (SM75..SM121, not Hopper). CI proves our graphs with it; it cannot run them here.
- `lean` (`tensorrt_lean`): the runtime-only library; loads plans built with VERSION_COMPATIBLE.

Their Python APIs share every name this project uses (tests/test_trt_api.py checks them against TensorRT 11 and
10.16); the one RTX-only call, choosing the target compute capability, lives in `set_target`.
"""

import importlib

from .errors import HiggsError

# module names to try: the packages' documented names, then their bindings wheels' own module names
MODULES = {"tensorrt": ("tensorrt", "tensorrt_bindings"), "rtx": ("tensorrt_rtx_bindings",),
           "lean": ("tensorrt_lean", "tensorrt_lean_bindings")}
INSTALL = {"tensorrt": "pip install 'higgs-trt[trt]' (on a machine with an NVIDIA GPU)",
           "rtx": "pip install 'higgs-trt[rtx]'", "lean": "pip install tensorrt-lean-cu13"}
TARGETS = ("sm75", "sm80", "sm86", "sm89", "sm120", "sm121")  # TensorRT-RTX compute capabilities


def try_load(kind: str):
    """(module, None), or (None, why not) when no module of this flavour imports here."""
    problems = []
    for name in MODULES[kind]:
        try:
            return importlib.import_module(name), None
        except Exception as e:  # ImportError, or a bindings module whose native libraries fail to load
            problems.append(f"{name}: {str(e).splitlines()[0] if str(e) else type(e).__name__}")
    return None, "; ".join(problems)


def load(kind: str):
    module, problem = try_load(kind)
    if module is None:
        raise HiggsError(f"TensorRT ({kind}) is not usable here ({problem}); {INSTALL[kind]}")
    return module


MIN_VERSION = (10, 15)  # the ONNX parser maps RotaryEmbedding, TensorScatter (KV-cache layer) and Attention from 10.15


def version_problem(trt) -> str | None:
    """Why this datacenter TensorRT is too old for our graphs, or None."""
    try:
        have = tuple(int(x) for x in trt.__version__.split(".")[:2])
    except (AttributeError, ValueError):
        return f"unknown TensorRT version {getattr(trt, '__version__', None)!r}"
    if have < MIN_VERSION:
        return (f"TensorRT {trt.__version__} is too old: the graphs need {MIN_VERSION[0]}.{MIN_VERSION[1]}+ "
                "(RotaryEmbedding, KV-cache update and Attention layers); pip install -U 'tensorrt-cu13>=10.15'")
    return None


def check_target(target: str) -> None:
    if target not in TARGETS:
        raise HiggsError(f"unknown target {target!r}; TensorRT-RTX builds for {', '.join(TARGETS)}")


def set_target(trt, config, target: str) -> None:
    """TensorRT-RTX only: build for one named compute capability instead of the local GPU."""
    check_target(target)
    config.num_compute_capabilities = 1
    config.set_compute_capability(getattr(trt.ComputeCapability, target.upper()), 0)


def make_logger(trt, verbose: bool = False, keep=None):
    """An ILogger that keeps errors (to report them, each on one line) and prints warnings only when asked. `keep`
    picks further messages, of any severity, to keep in `kept` (the builder's layer information)."""

    class Logger(trt.ILogger):
        def __init__(self):
            trt.ILogger.__init__(self)
            self.errors: list[str] = []
            self.kept: list[str] = []

        def log(self, severity, msg):
            if severity <= trt.ILogger.Severity.ERROR:
                self.errors.append(" ".join(str(msg).split()))
            elif verbose and severity <= trt.ILogger.Severity.WARNING:
                print(f"[TensorRT] {msg}")
            if keep is not None and keep(msg):
                self.kept.append(msg)

    return Logger()
