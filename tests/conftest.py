import shutil
from pathlib import Path

import pytest
from filelock import FileLock


def built_once(request, tmp_path_factory, name: str, build) -> Path:
    """`build(directory)` once for the whole run: with several xdist workers (make test) the first to ask builds it in
    the run's shared temporary directory while the others wait on a file lock, then every worker reads it."""
    if not hasattr(request.config, "workerinput"):  # a single process
        return build(tmp_path_factory.mktemp(name))
    root = tmp_path_factory.getbasetemp().parent
    with FileLock(root / f"{name}.lock"):
        done = root / f"{name}.path"
        if not done.exists():
            (root / name).mkdir()
            done.write_text(str(build(root / name)))
        return Path(done.read_text())


@pytest.fixture(scope="session")
def tiny_ckpt(request, tmp_path_factory) -> Path:
    """The built-in tiny checkpoint (sharded, as the real one may be). Treat as read-only."""
    from higgs_trt.builder.tiny import write_random_checkpoint

    return built_once(request, tmp_path_factory, "tiny", lambda d: write_random_checkpoint(d / "ckpt", seed=0))


@pytest.fixture
def tiny_copy(tiny_ckpt, tmp_path) -> Path:
    """A private copy of the tiny checkpoint that a test may damage."""
    return Path(shutil.copytree(tiny_ckpt, tmp_path / "ckpt"))


def tiny_export(ckpt: Path, **options):
    """export_engine of the tiny checkpoint into a directory given later, quietly, with tiny_engine's limits unless
    `options` say otherwise."""
    from higgs_trt.builder.checkpoint import Checkpoint
    from higgs_trt.builder.export import export_engine

    limits = {"max_seq": 160, "max_batch": 4, "max_prompt": 96, **options}
    return lambda directory: export_engine(Checkpoint(ckpt), directory / "engine", say=lambda msg: None, **limits)


@pytest.fixture(scope="session")
def tiny_engine(request, tiny_ckpt, tmp_path_factory) -> Path:
    """The tiny checkpoint exported with the native op path (small cache to keep ORT fast). Read-only."""
    return built_once(request, tmp_path_factory, "engine", tiny_export(tiny_ckpt))


@pytest.fixture(scope="module")
def engine(tiny_engine):
    """tiny_engine on ONNX Runtime through the host stepper: one per test module (its slots and prefix cache)."""
    from higgs_trt.runtime.backends.ort import OrtBackend
    from higgs_trt.runtime.manifest import EngineDir
    from higgs_trt.runtime.stepper import HostStepper

    return HostStepper(OrtBackend(EngineDir(tiny_engine)))


@pytest.fixture(scope="session")
def serve_engine(request, tiny_ckpt, tmp_path_factory) -> Path:
    """The tiny checkpoint with a longer cache than tiny_engine's, so a served request can outlast a disconnect and a
    long text's segments carry history. Read-only."""
    return built_once(request, tmp_path_factory, "serve", tiny_export(tiny_ckpt, max_seq=1024, max_prompt=160))


@pytest.fixture
def engine_copy(tiny_engine, tmp_path) -> Path:
    """A private copy of the tiny engine directory that a test may damage."""
    return Path(shutil.copytree(tiny_engine, tmp_path / "engine"))


@pytest.fixture(scope="session")
def tiny_calibration(request, tiny_ckpt, tmp_path_factory) -> Path:
    from higgs_trt.builder.checkpoint import Checkpoint
    from higgs_trt.builder.torch_backend import bf16_reference
    from higgs_trt.calibration.calibrate import calibrate, write_calibration

    def build(directory: Path) -> Path:
        write_calibration(calibrate(bf16_reference(Checkpoint(tiny_ckpt))), directory / "calibration.json")
        return directory / "calibration.json"

    return built_once(request, tmp_path_factory, "calibration", build)


@pytest.fixture(scope="session")
def tiny_fp8_engine(request, tiny_ckpt, tiny_calibration, tmp_path_factory) -> Path:
    """The tiny checkpoint exported with FP8 Q/DQ graphs (same limits as tiny_engine). Read-only."""
    return built_once(request, tmp_path_factory, "engine8",
                      tiny_export(tiny_ckpt, precision="fp8", calibration=tiny_calibration))


@pytest.fixture(scope="session")
def tiny_plugin_engine(request, tiny_ckpt, tmp_path_factory) -> Path:
    """The tiny checkpoint exported with the plugin op path (same limits as tiny_engine). Read-only."""
    from higgs_trt.builder.plugin_ops import PluginOps

    return built_once(request, tmp_path_factory, "engine_plugin", tiny_export(tiny_ckpt, ops=PluginOps))


LM_VARIANTS = [(ops, attention, precision) for ops, attention in (("native", "fused"), ("native", "matmul"),
                                                                  ("plugin", "fused"))
               for precision in ("bf16", "fp8")]  # what export can produce for TensorRT: op path × attention × precision


def _lm_graphs(ckpt_dir: Path, calibration: Path, directory: Path, ops, twin: bool) -> dict:
    """The lm graphs alone (bf16 and FP8, with `twin` their fp32 twins), tiny_engine's cache length."""
    from higgs_trt.builder.checkpoint import Checkpoint
    from higgs_trt.builder.export import WeightsFile, export_lm_graphs
    from higgs_trt.calibration.calibrate import load_calibration

    ckpt = Checkpoint(ckpt_dir)
    weights = WeightsFile(directory / "weights.bin", ckpt)
    try:
        graphs = export_lm_graphs(ckpt, weights, directory, 160, ops, load_calibration(calibration, ckpt.fingerprint()),
                                  say=lambda msg: None, twin=twin)
    finally:
        weights.close()
    return {key: {"file": directory / g["file"], "io": g} for key, g in graphs.items()}


@pytest.fixture(scope="session")
def tiny_matmul_lm(tiny_ckpt, tiny_calibration, tmp_path_factory) -> dict:
    """The native path's lm graphs with --attention matmul (bf16, FP8 and their fp32 twins), by graph key. Read-only."""
    from higgs_trt.builder.ops import MatmulAttentionOps

    return _lm_graphs(tiny_ckpt, tiny_calibration, tmp_path_factory.mktemp("lm-matmul"), MatmulAttentionOps, True)


@pytest.fixture(scope="session")
def lm_variants(tiny_engine, tiny_fp8_engine, tiny_plugin_engine, tiny_matmul_lm, tiny_ckpt, tiny_calibration,
                tmp_path_factory) -> dict:
    """Every lm graph export can produce for TensorRT (LM_VARIANTS), each exported once for the session: the
    engines above hold most; the plugin path's FP8 graph is exported here alone. Maps a variant to
    {"file": the graph, "io": its manifest entry}. Read-only."""
    from higgs_trt.builder.plugin_ops import PluginOps
    from higgs_trt.runtime.manifest import EngineDir

    def entry(engine: Path, key: str) -> dict:
        graph = EngineDir(engine).graph(key)
        return {"file": engine / graph["file"], "io": graph}

    plugin = _lm_graphs(tiny_ckpt, tiny_calibration, tmp_path_factory.mktemp("lm-plugin"), PluginOps, False)
    return {("native", "fused", "bf16"): entry(tiny_engine, "lm"), ("native", "fused", "fp8"): entry(tiny_fp8_engine, "lm_fp8"),
            ("native", "matmul", "bf16"): tiny_matmul_lm["lm"], ("native", "matmul", "fp8"): tiny_matmul_lm["lm_fp8"],
            ("plugin", "fused", "bf16"): entry(tiny_plugin_engine, "lm"), ("plugin", "fused", "fp8"): plugin["lm_fp8"]}


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
