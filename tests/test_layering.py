"""Imports run one way (docs/architecture.md, "Layers"): every import of a higgs_trt module, at module level or
inside a function, goes to the module's own layer or to one the layer may use. Read from the source (ast), so a
lazy import inside a command counts as much as one at the top of a file."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"runtime": "higgs_trt.runtime", "plugins": "higgs_trt.plugins", "builder": "higgs_trt.builder",
           "calibration": "higgs_trt.calibration", "engines": "higgs_trt.engines"}
# A module belongs to the layer of its longest matching prefix.
LAYER_OF_PREFIX = {
    "higgs_trt.runtime": "base",
    "higgs_trt.engines": "base",
    "higgs_trt.plugins": "kernels",
    "higgs_trt.runtime.backends": "backends",
    "higgs_trt.runtime.gpu": "backends",
    "higgs_trt.calibration": "calibration",
    "higgs_trt.builder": "builder",
    "higgs_trt.runtime.server": "server",
    "higgs_trt.runtime.cluster": "cluster",
    "higgs_trt.runtime.bench": "bench",
    "higgs_trt.runtime.cli": "cli",
}
# What each layer may import besides itself.
USES = {
    "base": set(),
    "kernels": {"base"},
    "backends": {"base", "kernels"},
    "calibration": {"base", "kernels", "backends"},
    "builder": {"base", "kernels", "backends", "calibration"},
    "server": {"base"},
    "cluster": {"base", "server"},
    "bench": {"base", "kernels", "backends", "calibration", "builder", "server"},
    "cli": {"base", "kernels", "backends", "calibration", "builder", "server", "cluster", "bench"},
}


def layer(module: str) -> str:
    best = max((p for p in LAYER_OF_PREFIX if module == p or module.startswith(p + ".")), key=len)
    return LAYER_OF_PREFIX[best]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([FOLDERS[parts[0]], *parts[1:]])


def imported(path: Path, module: str) -> list[tuple[int, str]]:
    """(line, module) of every higgs_trt import in the file, relative ones resolved."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            # `from pkg import mod` imports pkg.mod when mod is a module
            found += [(node.lineno, f"{base}.{a.name}" if _is_module(f"{base}.{a.name}") else base) for a in node.names]
    return [(line, m) for line, m in found if m.startswith("higgs_trt.")]


def _is_module(name: str) -> bool:
    parts = name.split(".")
    if len(parts) < 2 or f"higgs_trt.{parts[1]}" not in FOLDERS.values():
        return False
    folder = ROOT / next(k for k, v in FOLDERS.items() if v == f"higgs_trt.{parts[1]}")
    target = folder.joinpath(*parts[2:])
    return target.with_suffix(".py").is_file() or (target / "__init__.py").is_file()


def sources() -> list[Path]:
    return sorted(p for folder in FOLDERS for p in (ROOT / folder).rglob("*.py"))


def violations() -> list[str]:
    found = []
    for path in sources():
        module = module_name(path)
        own = layer(module)
        for line, target in imported(path, module):
            other = layer(target)
            if other != own and other not in USES[own]:
                found.append(f"{path.relative_to(ROOT)}:{line}: {own} imports {target} ({other})")
    return found


def test_imports_run_one_way():
    assert violations() == []


def test_every_stage_module_has_a_layer_and_the_layers_form_no_cycle():
    assert {layer(module_name(p)) for p in sources()} <= set(USES)
    seen, order = set(), []

    def visit(name, path=()):
        assert name not in path, f"layers import each other: {' -> '.join((*path, name))}"
        if name not in seen:
            for lower in sorted(USES[name]):
                visit(lower, (*path, name))
            seen.add(name)
            order.append(name)

    for name in USES:
        visit(name)
    assert order.index("base") == 0


@pytest.mark.parametrize("source, target, ok", [
    ("higgs_trt.runtime.prompt", "higgs_trt.builder.checkpoint", False),
    ("higgs_trt.plugins.qdp", "higgs_trt.runtime.errors", True),
    ("higgs_trt.runtime.gpu.engine", "higgs_trt.calibration.qdq", False),
    ("higgs_trt.calibration.calibrate", "higgs_trt.builder.torch_backend", False),
    ("higgs_trt.runtime.server.app", "higgs_trt.runtime.backends.ort", False),
    ("higgs_trt.runtime.cluster.replica", "higgs_trt.runtime.server.engine_thread", True),
    ("higgs_trt.runtime.cluster.replica", "higgs_trt.runtime.backends.ort", False),
    ("higgs_trt.runtime.server.app", "higgs_trt.runtime.cluster.ingress", False),
    ("higgs_trt.runtime.cli.build", "higgs_trt.builder.export", True),
])
def test_the_rule_refuses_what_it_should(source, target, ok):
    assert (layer(source) == layer(target) or layer(target) in USES[layer(source)]) is ok
