"""Clear errors when a command needs an optional dependency group that is not installed."""

from contextlib import contextmanager

from .errors import HiggsError


@contextmanager
def needed(extra: str, what: str):
    try:
        yield
    except ModuleNotFoundError as e:
        raise HiggsError(f"{what} needs the '{extra}' extra ({e.name} is not installed): "
                         f"pip install 'higgs-trt[{extra}]'") from None
