"""The seams stay typed and the wires stay visible (docs/architecture.md, issue 21), read from the source's AST:

* at most ``MAX_ANY`` parameters in ``psrl/rollout/`` are typed ``Any``, each with a comment saying why;
* no listener, hook or log callable is assigned onto another object after construction (``x.on_* = ...``,
  ``x.log_* = ...``, ``x.log = ...`` with ``x`` not ``self``): objects get them as constructor arguments;
* no module imports another module's private names (``from psrl.x import _y``).
"""

import ast
from pathlib import Path

from tests.source_ast import parse

SRC = Path(__file__).resolve().parent.parent / "src" / "psrl"
MAX_ANY = 5
_WRAPPERS = {"Optional", "Union", "Sequence", "Iterable", "Collection", "list", "set", "frozenset", "tuple", "type"}
"""Generics that only wrap their argument: ``Optional[Any]`` or ``Sequence[Any]`` say no more than ``Any``. A mapping
to ``Any`` (a state dict) or a callable returning ``Any`` does say what the parameter is."""


def _name(node: ast.expr) -> str:
    return node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""


def is_any(node: ast.expr) -> bool:
    """Whether an annotation says no more than ``Any``."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):  # a quoted annotation
        node = ast.parse(node.value, mode="eval").body
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        return is_any(node.left) or is_any(node.right)
    if isinstance(node, ast.Subscript) and _name(node.value) in _WRAPPERS:
        args = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
        return any(is_any(a) for a in args)
    return _name(node) == "Any"


def any_parameters(path: Path) -> list[tuple[str, bool]]:
    """``("file:line function(param)", has a comment on its line)`` for every parameter typed ``Any`` in ``path``."""
    lines = path.read_text().splitlines()
    out = []
    for node in ast.walk(parse(path)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            for p in [*a.posonlyargs, *a.args, *a.kwonlyargs, *(x for x in (a.vararg, a.kwarg) if x)]:
                if p.annotation is not None and is_any(p.annotation):
                    out.append((f"{path.relative_to(SRC)}:{p.lineno} {node.name}({p.arg})", "#" in lines[p.lineno - 1]))
    return out


def test_at_most_five_parameters_in_rollout_are_typed_any_each_saying_why():
    found = [x for path in sorted((SRC / "rollout").rglob("*.py")) for x in any_parameters(path)]
    assert len(found) <= MAX_ANY, [where for where, _ in found]
    assert [where for where, why in found if not why] == []


def test_the_any_check_sees_through_wrappers_and_quotes():
    typed = "def f(a: Any, b: 'Any', c: Optional[Any], d: Sequence[typing.Any], e: int | Any, *f: Any, **g: Any): pass"
    said = "def f(a: dict[str, Any], b: Callable[..., Any], c: Optional[int], d: 'Config', e=None): pass"
    params = ast.parse(typed + "\n" + said).body
    kinds = [
        [
            is_any(p.annotation)
            for p in (*fn.args.args, *(x for x in (fn.args.vararg, fn.args.kwarg) if x))
            if p.annotation is not None
        ]
        for fn in params
    ]
    assert kinds == [[True] * 7, [False] * 4]


def wires_set_from_outside(tree: ast.Module) -> list[str]:
    """``x.on_* = ...``, ``x.log_* = ...`` and ``x.log = ...`` (also ``setattr(x, "on_...", ...)``) with ``x`` not
    ``self``."""

    def hook(attr: str) -> bool:
        return attr.startswith(("on_", "log_")) or attr == "log"

    out = []
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = [t for tgt in node.targets for t in (tgt.elts if isinstance(tgt, ast.Tuple) else [tgt])]
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            targets = [node.target]
        for t in targets:
            if isinstance(t, ast.Attribute) and hook(t.attr) and ast.unparse(t.value) != "self":
                out.append(f"{node.lineno}: {ast.unparse(t)} = ...")
        if (
            isinstance(node, ast.Call)
            and _name(node.func) == "setattr"
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and hook(str(node.args[1].value))
            and ast.unparse(node.args[0]) != "self"
        ):
            out.append(f"{node.lineno}: {ast.unparse(node)}")
    return out


def test_no_listener_or_log_is_assigned_onto_another_object():
    found = [
        f"{path.relative_to(SRC)}:{w}"
        for path in sorted(SRC.rglob("*.py"))
        for w in wires_set_from_outside(parse(path))
    ]
    assert found == []


def test_the_wire_check_sees_every_form():
    src = (
        "inst.on_version = f\nself.on_round = g\ncoord.manager.on_event, x = ev, 1\nobj.log = print\n"
        "inst.log_failure = log\nsetattr(inst, 'on_round', f)\nself.log = log\nobj.logger = x\n"
    )
    assert [w.split(":")[0] for w in wires_set_from_outside(ast.parse(src))] == ["1", "3", "4", "5", "6"]


def private_imports(tree: ast.Module, package: str = "") -> list[str]:
    """``from psrl.x import _y``: a private name of another module. Modules of one package (``package``, e.g.
    ``psrl.config``) share its internals; what the outside may import of a package is checked by test_layers."""
    return [
        f"{node.lineno}: from {node.module} import {a.name}"
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom)
        and node.level == 0
        and (node.module or "").startswith("psrl")
        and not (package and (node.module == package or (node.module or "").startswith(package + ".")))
        for a in node.names
        if a.name.startswith("_") and not a.name.startswith("__")
    ]


def test_no_module_imports_a_private_name_of_another():
    found = [
        f"{path.relative_to(SRC)}:{w}"
        for path in sorted(SRC.rglob("*.py"))
        for w in private_imports(
            parse(path), ".".join(("psrl", *path.relative_to(SRC).parent.parts)) if path.parent != SRC else ""
        )
    ]
    assert found == []


def test_the_private_import_check_sees_another_package_only():
    """Not vacuous: a private name from another package is caught; one from the importer's own package is not."""
    src = (
        "from psrl.config.fields import _f\nfrom psrl.models.policy import _left_pad\nfrom psrl.config import Config\n"
    )
    assert private_imports(ast.parse(src), "psrl.config") == ["2: from psrl.models.policy import _left_pad"]
    assert len(private_imports(ast.parse(src), "psrl.runtime")) == 2
