import shutil
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory) -> Path:
    """The built-in tiny checkpoint (sharded, as the real one may be). Treat as read-only."""
    from higgs_trt.builder.tiny import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt", seed=0)


@pytest.fixture
def tiny_copy(tiny_ckpt, tmp_path) -> Path:
    """A private copy of the tiny checkpoint that a test may damage."""
    return Path(shutil.copytree(tiny_ckpt, tmp_path / "ckpt"))
