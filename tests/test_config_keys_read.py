"""Every key of the typed config is read by some code outside the config module (issue #15).

A key nothing reads is silently accepted and silently ignored -- worse than an unknown key, which is
rejected. This is a static scan (fast, and it sees every mode: Ray, GGUF, trace replay, ...): a key
``section.sub.name`` counts as read when ``src/psrl`` (outside the ``psrl.config`` package, whose
validation reads everything) holds an attribute access ``X.name`` where ``X`` is a config object:

* a parameter or variable named like a config (``cfg``, ``model_cfg``, ``psrl_config``, annotated ``...Config``);
* an attribute named after a section (``cfg.trainer``, ``p.redundant_rollout``, ``anything.gen_time``);
* a variable or ``self.x`` assigned from one of those (``p = cfg.psrl``; ``s, p = cfg.sim, cfg.psrl``);
* a parameter of a function or class that some call site passes a config object to (``Foo(cfg.task)``
  marks ``Foo.__init__``'s parameter), propagated until nothing changes.

The derived sizes (``PsrlConfig.batch_size`` ...) are properties of the config package's sections: what they read counts as
read when the property itself is read.
"""

from __future__ import annotations

import ast
import dataclasses
import re
import typing
from pathlib import Path

from psrl.config import Config, leaf_keys
from tests.source_ast import parse

SRC = Path(__file__).resolve().parents[1] / "src" / "psrl"
CONFIG = SRC / "config"
"""The config package: skipped by the scan (its validation reads every key)."""

UNREAD_ALLOWLIST: set[str] = set()
"""Keys allowed to be read by nothing (none today); each entry needs a comment saying why."""

_CFG_NAME = re.compile(r"(^|_)(cfg|config|conf)$")


def leaf_fields() -> dict[str, tuple[type, str]]:
    """``{dotted key: (annotated type, attribute name)}`` for every leaf key."""
    return {k: (tp, f.name) for k, (tp, f) in leaf_keys().items()}


def section_attrs(cls: type = Config) -> set[str]:
    """Attribute names that hold a config section (``psrl``, ``gen_time``, ``redundant_rollout`` ...)."""
    out = set()
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            out.add(f.name)
            out |= section_attrs(hints[f.name])
    return out


class _Scan:
    """Attribute names read from config objects across ``src/psrl``."""

    def __init__(self, trees: dict[str, ast.Module], sections: set[str], properties: set[str]):
        self.trees, self.sections, self.properties = trees, sections, properties
        self.cfg_params: set[tuple[str, int | str]] = set()  # (callee name, position or keyword)
        self.read: set[str] = set()

    def run(self) -> set[str]:
        for _ in range(5):  # propagate config objects through call sites until stable
            before = (len(self.cfg_params), len(self.read))
            for tree in self.trees.values():
                self._module(tree)
            if (len(self.cfg_params), len(self.read)) == before:
                break
        return self.read

    def _module(self, tree: ast.Module) -> None:
        self._body(tree, set(), set())
        for cls in [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]:
            self_attrs: set[str] = set()
            for _ in range(2):  # self.x assigned in one method, read in another
                for fn in [n for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]:
                    self._function(fn, cls.name, self_attrs)
        for fn in tree.body:
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                self._function(fn, None, set())

    def _function(self, fn, cls_name, self_attrs: set[str]) -> None:
        names: set[str] = set()
        callee = cls_name if fn.name == "__init__" and cls_name else fn.name
        params = fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs
        offset = 1 if params and params[0].arg in ("self", "cls") else 0
        for i, a in enumerate(params):
            ann = ast.unparse(a.annotation) if a.annotation is not None else ""
            if (
                _CFG_NAME.search(a.arg)
                or ann.endswith("Config")
                or (callee, i - offset) in self.cfg_params
                or (callee, a.arg) in self.cfg_params
            ):
                names.add(a.arg)
        self._body(fn, names, self_attrs)

    def _is_cfg(self, e: ast.AST, names: set[str], self_attrs: set[str]) -> bool:
        if isinstance(e, ast.Name):
            return e.id in names or bool(_CFG_NAME.search(e.id))
        if isinstance(e, ast.Attribute):
            if e.attr in self.sections:
                return True
            if isinstance(e.value, ast.Name) and e.value.id == "self" and e.attr in self_attrs:
                return True
            return bool(_CFG_NAME.search(e.attr))
        return False

    def _body(self, node: ast.AST, names: set[str], self_attrs: set[str]) -> None:
        for n in ast.walk(node):
            if isinstance(n, ast.Assign):
                pairs = []
                for t in n.targets:
                    if isinstance(t, ast.Tuple) and isinstance(n.value, ast.Tuple):
                        pairs += list(zip(t.elts, n.value.elts))
                    else:
                        pairs.append((t, n.value))
                for t, v in pairs:
                    if self._is_cfg(v, names, self_attrs):
                        if isinstance(t, ast.Name):
                            names.add(t.id)
                        elif isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                            self_attrs.add(t.attr)
            elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Load):
                if self._is_cfg(n.value, names, self_attrs):
                    self.read.add(n.attr)
            elif isinstance(n, ast.Call):
                fname = n.func.attr if isinstance(n.func, ast.Attribute) else getattr(n.func, "id", None)
                if fname == "getattr" and len(n.args) >= 2 and isinstance(n.args[1], ast.Constant):
                    if self._is_cfg(n.args[0], names, self_attrs):
                        self.read.add(n.args[1].value)
                if fname:
                    for i, a in enumerate(n.args):
                        if self._is_cfg(a, names, self_attrs):
                            self.cfg_params.add((fname, i))
                    for k in n.keywords:
                        if k.arg and self._is_cfg(k.value, names, self_attrs):
                            self.cfg_params.add((fname, k.arg))


def _property_reads() -> dict[str, set[str]]:
    """``{property name: attribute names its body reads}`` for the config dataclasses' properties."""
    out: dict[str, set[str]] = {}
    trees = [parse(p) for p in sorted(CONFIG.rglob("*.py"))]
    for fn in (n for tree in trees for n in ast.walk(tree)):
        if isinstance(fn, ast.FunctionDef) and any(getattr(d, "id", "") == "property" for d in fn.decorator_list):
            out[fn.name] = {n.attr for n in ast.walk(fn) if isinstance(n, ast.Attribute)}
    return out


def read_attributes() -> set[str]:
    trees = {str(p): parse(p) for p in sorted(SRC.rglob("*.py")) if CONFIG not in p.parents}
    props = _property_reads()
    read = _Scan(trees, section_attrs(), set(props)).run()
    for _ in range(3):  # a property read counts as reading what the property reads
        for name, attrs in props.items():
            if name in read:
                read |= attrs
    return read


def no_effect_keys() -> set[str]:
    """PSRL keys accepted with no effect here: their field says why (``effect=``), and the fate table shows it."""
    return {k for k, (_, f) in leaf_keys().items() if "effect" in f.metadata}


def test_every_config_key_is_read_by_something():
    """A key nothing reads: remove it, wire it up, or (a PSRL key with no meaning here) give it ``effect=``."""
    read = read_attributes()
    skip = UNREAD_ALLOWLIST | no_effect_keys()
    unread = sorted(k for k, (_, attr) in leaf_fields().items() if attr not in read and k not in skip)
    assert unread == [], f"config keys that nothing in src/psrl reads: {unread}"


def test_no_effect_keys_are_psrl_keys_with_a_reason():
    """Only PSRL's own keys may be accepted with no effect, and each says why."""
    for k in no_effect_keys():
        assert k.startswith("psrl."), k
        assert len(leaf_keys()[k][1].metadata["effect"]) > 20, k


def test_the_allowlist_holds_only_unread_keys():
    """An allowlisted key that is read now must leave the allowlist, so the check covers it again."""
    read = read_attributes()
    fields = leaf_fields()
    assert all(k in fields for k in UNREAD_ALLOWLIST), "allowlisted key no longer exists"
    stale = sorted(k for k in UNREAD_ALLOWLIST if fields[k][1] in read)
    assert stale == [], f"these keys are read now; remove them from UNREAD_ALLOWLIST: {stale}"


def test_the_scan_sees_a_key_that_nothing_reads(tmp_path):
    """The scan is not vacuous: a module that reads one key marks exactly it, not its neighbours."""
    tree = ast.parse(
        "def f(cfg):\n    t = cfg.trainer\n    return t.lr\n\nclass A:\n    def __init__(self, s):\n"
        "        self.s = s\n    def g(self):\n        return self.s.weight_decay\n\nA(cfg.trainer)\n"
    )
    read = _Scan({"m": tree}, section_attrs(), set()).run()
    assert {"lr", "weight_decay"} <= read and "grad_clip" not in read


def test_selector_keys_list_exactly_what_the_code_implements():
    """A choice the code does not implement would load and then fail mid-run (or be ignored)."""
    from psrl.algo.advantages import ADV_ESTIMATORS
    from psrl.tasks.registry import TASKS

    rule = {f.name: f.metadata.get("rule") for f in dataclasses.fields(Config().algorithm)}
    assert set(rule["adv_estimator"].choices) == set(ADV_ESTIMATORS)
    task_rule = {f.name: f.metadata.get("rule") for f in dataclasses.fields(Config().task)}["name"]
    assert all(name in task_rule.describe() for name in TASKS)
