"""Dependencies point one way (docs/architecture.md): no module imports a layer above its own, at module level or
inside a function, and there is no cycle between the substrate packages (``models`` does not import ``tasks``)."""

import ast
from pathlib import Path

from tests.source_ast import parse

SRC = Path(__file__).resolve().parents[1] / "src" / "psrl"
RANK = {
    "staleness": 0, "types": 0, "errors": 0, "metrics": 0,
    "models": 2, "algo": 2, "tasks": 3,
    "config": 3.5, "config_rules": 3.5,
    "train": 4, "rollout": 4,
    "runtime": 5,
    "sim": 6, "viz": 6,
    "cli": 7, "train_cli": 7, "config_cli": 7, "__init__": 7,
}
"""Layer of each top-level module or package: ``tasks`` sits above ``models`` (a task uses a tokenizer); the
configuration schema above ``tasks`` (it resolves ``task.name`` at load), below everything that reads it."""


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(parse(path)):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return {m.split(".")[1] for m in out if m.startswith("psrl.")}


def test_no_module_imports_a_layer_above_its_own():
    wrong = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).parts
        own = rel[0].removesuffix(".py")
        if own == "__init__" or own not in RANK:
            continue
        for dep in _imports(path):
            if dep in RANK and RANK[dep] > RANK[own]:
                wrong.append(f"{'/'.join(rel)} imports psrl.{dep}")
    assert wrong == []


def test_the_staleness_core_imports_only_itself():
    deps = {d for p in (SRC / "staleness").rglob("*.py") for d in _imports(p)}
    assert deps <= {"staleness"}
