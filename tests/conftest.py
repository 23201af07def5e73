import shutil
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory) -> Path:
    """The built-in tiny checkpoint (sharded, as the real one may be). Treat as read-only."""
    from higgs_trt.builder.tiny import write_random_checkpoint

    return write_random_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt", seed=0)


@pytest.fixture
def tiny_copy(tiny_ckpt, tmp_path) -> Path:
    """A private copy of the tiny checkpoint that a test may damage."""
    return Path(shutil.copytree(tiny_ckpt, tmp_path / "ckpt"))


@pytest.fixture(scope="session")
def tiny_engine(tiny_ckpt, tmp_path_factory) -> Path:
    """The tiny checkpoint exported with the native op path (small cache to keep ORT fast). Read-only."""
    from higgs_trt.builder.checkpoint import Checkpoint
    from higgs_trt.builder.export import export_engine

    return export_engine(Checkpoint(tiny_ckpt), tmp_path_factory.mktemp("engine") / "tiny", max_seq=160, max_batch=4,
                         max_prompt=96, say=lambda msg: None)


@pytest.fixture
def engine_copy(tiny_engine, tmp_path) -> Path:
    """A private copy of the tiny engine directory that a test may damage."""
    return Path(shutil.copytree(tiny_engine, tmp_path / "engine"))


@pytest.fixture(scope="session")
def tiny_calibration(tiny_ckpt, tmp_path_factory) -> Path:
    from higgs_trt.builder.checkpoint import Checkpoint
    from higgs_trt.builder.torch_backend import bf16_reference
    from higgs_trt.calibration.calibrate import calibrate, write_calibration

    path = tmp_path_factory.mktemp("calibration") / "calibration.json"
    write_calibration(calibrate(bf16_reference(Checkpoint(tiny_ckpt))), path)
    return path


@pytest.fixture(scope="session")
def tiny_fp8_engine(tiny_ckpt, tiny_calibration, tmp_path_factory) -> Path:
    """The tiny checkpoint exported with FP8 Q/DQ graphs (same limits as tiny_engine). Read-only."""
    from higgs_trt.builder.checkpoint import Checkpoint
    from higgs_trt.builder.export import export_engine

    return export_engine(Checkpoint(tiny_ckpt), tmp_path_factory.mktemp("engine8") / "tiny8", max_seq=160, max_batch=4,
                         max_prompt=96, say=lambda msg: None, precision="fp8", calibration=tiny_calibration)


@pytest.fixture(scope="session")
def tiny_plugin_engine(tiny_ckpt, tmp_path_factory) -> Path:
    """The tiny checkpoint exported with the plugin op path (same limits as tiny_engine). Read-only."""
    from higgs_trt.builder.checkpoint import Checkpoint
    from higgs_trt.builder.export import export_engine
    from higgs_trt.builder.plugin_ops import PluginOps

    return export_engine(Checkpoint(tiny_ckpt), tmp_path_factory.mktemp("engine_plugin") / "tinyp", max_seq=160, max_batch=4,
                         max_prompt=96, ops=PluginOps, say=lambda msg: None)


def pytest_collection_modifyitems(config, items):
    """GPU tests run on a machine with an NVIDIA GPU and torch built with CUDA; elsewhere they are skipped."""
    try:
        import torch

        gpu = torch.cuda.is_available()
    except ImportError:
        gpu = False
    if not gpu:
        skip = pytest.mark.skip(reason="needs an NVIDIA GPU (run on the GPU host)")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)
