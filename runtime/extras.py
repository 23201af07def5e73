"""Clear errors when a command needs an optional dependency group that is not installed, or a GPU that is not there."""

from contextlib import contextmanager

from .errors import HiggsError


@contextmanager
def needed(extra: str, what: str):
    try:
        yield
    except ModuleNotFoundError as e:
        raise HiggsError(f"{what} needs the '{extra}' extra ({e.name} is not installed): "
                         f"pip install 'higgs-trt[{extra}]'") from None


def require_cuda(what: str) -> None:
    """One clear line where `what` must run on an NVIDIA GPU and torch offers none."""
    import torch

    if not torch.cuda.is_available():
        raise HiggsError(f"{what} needs torch built with CUDA and an NVIDIA GPU")
