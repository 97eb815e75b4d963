"""Dependencies point one way (docs/architecture.md): no module imports a layer above its own, at module level or
inside a function, and there is no cycle between the substrate packages (``models`` does not import ``tasks``).
Packages are entered by their front door: ``psrl.config`` only through the names its ``__init__`` exports."""

import ast
from pathlib import Path

from tests.source_ast import parse

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "psrl"
RANK = {
    "staleness": 0,
    "types": 0,
    "errors": 0,
    "metrics": 0,
    "heap": 0,
    "lifeline": 0,
    "models": 2,
    "algo": 2,
    "tasks": 3,
    "config": 3.5,
    "weights": 3.8,
    "train": 4,
    "rollout": 4,
    "runtime": 5,
    "sim": 6,
    "viz": 6,
    "cli": 7,
    "train_cli": 7,
    "config_cli": 7,
    "__init__": 7,
}
"""Layer of each top-level module or package: ``tasks`` sits above ``models`` (a task uses a tokenizer); ``weights``
(a version's format, publishing and reading it) below both ``train`` and ``rollout``; the
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


def test_rollout_and_train_are_siblings_over_weights():
    """The engines and the trainer meet only in ``psrl.weights`` (issue #33, item 2): neither imports the other."""
    for a, b in (("rollout", "train"), ("train", "rollout")):
        assert not [p for p in (SRC / a).rglob("*.py") if b in _imports(p)], f"psrl.{a} imports psrl.{b}"


def test_the_staleness_core_imports_only_itself():
    deps = {d for p in (SRC / "staleness").rglob("*.py") for d in _imports(p)}
    assert deps <= {"staleness"}


def _config_imports_from_outside(path: Path) -> list[str]:
    """What ``path`` imports of ``psrl.config`` other than the names of its ``__all__``."""
    import psrl.config

    wrong = []
    for node in ast.walk(parse(path)):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.startswith("psrl.config."):
                wrong.append(node.module)
            elif node.module == "psrl.config":
                wrong += [f"psrl.config.{a.name}" for a in node.names if a.name not in psrl.config.__all__]
        elif isinstance(node, ast.Import):
            wrong += [a.name for a in node.names if a.name.startswith("psrl.config.")]
    return wrong


def test_only_the_config_package_imports_its_internals():
    """Outside ``psrl/config/`` (src, tests, benchmarks), code imports ``from psrl.config import X`` with X in its
    ``__all__``: never a submodule (``psrl.config.load``) and never a private name (``_build``), so the package
    can be re-shaped behind its front door."""
    inside = SRC / "config"
    files = [
        p
        for d in ("src", "tests", "benchmarks", "examples")
        for p in sorted((ROOT / d).rglob("*.py"))
        if inside not in p.parents
    ]
    wrong = [f"{p.relative_to(ROOT)} imports {name}" for p in files for name in _config_imports_from_outside(p)]
    assert wrong == []


def test_the_internals_check_sees_a_private_import(tmp_path):
    """The check above is not vacuous: a submodule, a private name and an unexported name are each caught."""
    f = tmp_path / "m.py"
    f.write_text(
        "from psrl.config import Config, _build\nfrom psrl.config.load import leaf_keys\n"
        "import psrl.config.rules\nfrom psrl.config import hints\n"
    )
    assert _config_imports_from_outside(f) == [
        "psrl.config._build",
        "psrl.config.load",
        "psrl.config.rules",
        "psrl.config.hints",
    ]


MAX_LINES = 450
"""A module longer than this is probably two things (style.md, habit 11: aim for ~400). Counted in ``ruff format``
lines: the check allows 450 on formatted code (the formatter's one-argument-per-line calls take ~8% more lines than
hand-wrapped code, so a module near the limit is split rather than the limit raised)."""
TOO_LONG_TODAY = {
    "staleness/manager.py",  # the core's one manager class; its public names are a frozen contract
}
"""Modules over the limit when the limit came in: this set may only shrink (an entry that fits is an error)."""


def test_no_module_is_over_the_line_limit():
    lengths = {str(p.relative_to(SRC)): len(p.read_text().splitlines()) for p in sorted(SRC.rglob("*.py"))}
    over = {name for name, n in lengths.items() if n > MAX_LINES}
    assert over - TOO_LONG_TODAY == set(), {name: lengths[name] for name in over - TOO_LONG_TODAY}
    fits = TOO_LONG_TODAY - over
    assert fits == set(), f"these modules fit in {MAX_LINES} lines now: remove them from TOO_LONG_TODAY: {fits}"


ROOMS = {"engines": 1, "serving": 2, "client": 3, "build": 4}
"""The rooms of ``psrl.rollout``: the inference engines know nothing of the instances, pool and routing that serve
them (``serving``), which know nothing of the protocol client that fills the staleness buffers (``client``); only
``build`` wires all three. ``types`` (the Protocols between rooms) and ``fakes`` belong to no room."""


def _modules(tree: ast.Module, package: str) -> set[str]:
    """Every ``psrl.*`` module imported anywhere in ``tree`` (a module of ``package``); ``from psrl.rollout import
    serving`` names ``psrl.rollout.serving``."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: up from the package, level - 1 steps
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return {m for m in out if m.startswith("psrl.")}


def _room(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[1] == "rollout" and parts[2] in ROOMS else None


def _climbs(module: str, deps: set[str]) -> list[str]:
    """The imports of ``module`` that reach a rollout room above its own."""
    own = _room(module)
    if own is None:
        return []
    return sorted(d for d in deps if _room(d) is not None and ROOMS[_room(d)] > ROOMS[own])


def test_a_rollout_room_imports_no_room_above_its_own():
    """``rollout/engines/`` imports neither serving nor the protocol client; serving does not import the client."""
    wrong = []
    for path in sorted((SRC / "rollout").rglob("*.py")):
        module = ".".join(("psrl",) + path.relative_to(SRC).with_suffix("").parts)
        package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
        wrong += [f"{module} imports {d}" for d in _climbs(module, _modules(parse(path), package))]
    assert wrong == []


def test_the_room_check_catches_imports_inside_functions_and_relative_ones():
    """Not vacuous: an engine module importing the pool in a function, or the client relatively, is caught."""
    src = (
        "def f():\n    from psrl.rollout.serving.pool import InstancePool\n"
        "from ..client import agents\nfrom psrl.rollout import types\n"
    )
    deps = _modules(ast.parse(src), "psrl.rollout.engines")
    assert _climbs("psrl.rollout.engines.probe", deps) == [
        "psrl.rollout.client",
        "psrl.rollout.client.agents",
        "psrl.rollout.serving.pool",
        "psrl.rollout.serving.pool.InstancePool",
    ]
    assert _climbs("psrl.rollout.client.probe", deps) == []
