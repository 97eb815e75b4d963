"""What a configuration key is: a dataclass field with its help text and the :class:`Rule` of its values.

Every section of the schema declares its keys with :func:`_f` (a leaf) or :func:`_sub` (a section).
``Config.validate()`` checks each value against its :class:`Rule` (:func:`check_rules`), and the
generated reference (``docs/configuration.md``) prints :meth:`Rule.describe` in its "allowed"
column, so the documented range is the checked range. Rules that relate two keys are the
``check()`` methods of the section that owns them.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Any

from psrl.config.rules import check_file, check_out_dir, one_of
from psrl.errors import ConfigError, resolve_target


@dataclass(frozen=True)
class Rule:
    """The values one key accepts. ``None`` (null) is accepted exactly when the key's type is Optional."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    choices: tuple = ()
    """Allowed values; with ``target`` set, a value outside them is resolved as module:attr."""
    target: str = ""
    """``class`` or ``callable``: a ``module:attr`` value is imported at load."""
    path: str = ""
    """``file`` (an existing readable file), ``out_dir`` (created at run start; nearest existing parent
    writable), ``model_dir`` (checked with model.gguf_file by ``ModelConfig.check()``)."""
    fix: str = ""
    """How to fix an out-of-range value, when more helpful than restating the range."""
    note: str = ""
    """What the docs say for a key with no range (free strings, mappings)."""

    def check(self, key: str, value: Any) -> None:
        """Raise :class:`ConfigError` naming ``key`` when ``value`` breaks this rule (null is the type's business)."""
        if value is None:
            return
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            self._check_number(key, value)
        if self.target and value not in self.choices and isinstance(value, str) and ":" in value:
            resolve_target(key, value, self.target)
        elif self.choices or self.target:
            one_of(
                key,
                value,
                list(self.choices),
                extra="module:Class" if self.target == "class" else "module:function" if self.target else "",
            )
        if self.path == "file":
            check_file(key, value)
        elif self.path == "out_dir":
            check_out_dir(key, value)

    def _check_number(self, key: str, v: float) -> None:
        bad = (
            (self.ge is not None and v < self.ge)
            or (self.gt is not None and v <= self.gt)
            or (self.le is not None and v > self.le)
            or (self.lt is not None and v >= self.lt)
        )
        if bad:
            fix = self.fix or f"set {key} to a value {self.describe()}"
            raise ConfigError(key, f"must be {self.describe()}, got {v}", fix)

    def describe(self) -> str:
        """The allowed values in words, for the reference and for messages: ``>= 1``, ``(0, 1]``, ``a | b``."""
        lo = ("[", self.ge) if self.ge is not None else ("(", self.gt) if self.gt is not None else None
        hi = ("]", self.le) if self.le is not None else (")", self.lt) if self.lt is not None else None
        parts = []
        if lo and hi:
            parts.append(f"in {lo[0]}{_num(lo[1])}, {_num(hi[1])}{hi[0]}")
        elif lo:
            parts.append(f"{'>=' if lo[0] == '[' else '>'} {_num(lo[1])}")
        elif hi:
            parts.append(f"{'<=' if hi[0] == ']' else '<'} {_num(hi[1])}")
        if self.choices or self.target:
            names = ["null" if c is None else str(c) for c in self.choices]
            if self.target:
                names.append("module:Class" if self.target == "class" else "module:function")
            parts.append(" | ".join(names))
        if self.path == "file":
            parts.append("an existing, readable file")
        elif self.path == "out_dir":
            parts.append("a directory, created when the run starts (its nearest existing parent must be writable)")
        elif self.path == "model_dir":
            parts.append("a local model directory (config.json, weights, tokenizer; or a GGUF file in it)")
        if self.note:
            parts.append(self.note)
        return "; ".join(parts)


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(x)


def _f(default: Any, help: str, key: str | None = None, effect: str | None = None, **rule: Any) -> Any:
    """A config field with its help text, the :class:`Rule` of the values it accepts (its keywords:
    ``ge=0``, ``choices=(...)``, ``path="file"`` ...), optionally its YAML name when that is a Python
    keyword, and ``effect``: why a PSRL key is accepted but does nothing here."""
    meta: dict = {"help": help, "rule": Rule(**rule)}
    if key is not None:
        meta["key"] = key
    if effect is not None:
        meta["effect"] = effect
    if isinstance(default, (list, dict)):  # each config gets its own copy
        return field(default_factory=lambda: copy.deepcopy(default), metadata=meta)
    return field(default=default, metadata=meta)


def _sub(cls: type, help: str) -> Any:
    """A section: a field holding another section dataclass (its defaults unless the YAML sets keys)."""
    return field(default_factory=cls, metadata={"help": help})


def yaml_key(f: dataclasses.Field) -> str:
    """A field's name in YAML (``is`` for the field ``is_``)."""
    return f.metadata.get("key", f.name)


def check_rules(obj: Any, prefix: str = "", out_dirs: bool = False) -> None:
    """Every leaf field of ``obj`` against the :class:`Rule` in its metadata: all but the ``out_dir`` paths,
    or (``out_dirs=True``) only those -- ``validate()`` checks them last: the file system is the slowest check."""
    for f in dataclasses.fields(obj):
        key = f"{prefix}.{yaml_key(f)}" if prefix else yaml_key(f)
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            check_rules(value, key, out_dirs)
        elif (f.metadata["rule"].path == "out_dir") == out_dirs:
            f.metadata["rule"].check(key, value)
