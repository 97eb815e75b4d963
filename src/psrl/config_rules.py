"""What each configuration key may hold: the one owner of ranges, choices and path kinds.

Every field of :mod:`psrl.config` carries a :class:`Rule` in its metadata. ``Config.validate()``
checks each value against it, and the generated reference (``docs/configuration.md``) prints
:meth:`Rule.describe` in its "allowed" column, so the documented range is the checked range.
Rules that relate two keys stay in ``validate()``; this module holds the one-key rules and the
file-system checks they use (nothing is written: an output directory is probed with a temporary
directory that is removed at once, because ``os.access`` says yes to root on ``/proc``).

Stdlib only, so loading a config never pulls torch in.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import math
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from psrl.errors import ConfigError, resolve_target

__all__ = ["Rule", "check_out_dir", "check_file", "check_model", "check_task", "resolve_target", "one_of", "show"]

INT_MAX = 2**63 - 1
"""Integers are handed to torch and numpy: anything beyond int64 cannot be a sensible setting."""


@dataclass(frozen=True)
class Rule:
    """The values one key accepts. ``None`` (null) is accepted exactly when the key's type is Optional."""

    ge: Optional[float] = None
    gt: Optional[float] = None
    le: Optional[float] = None
    lt: Optional[float] = None
    choices: tuple = ()
    """Allowed values; with ``target`` set, a value outside them is resolved as module:attr."""
    target: str = ""
    """``class`` or ``callable``: a ``module:attr`` value is imported at load."""
    path: str = ""
    """``file`` (an existing readable file), ``out_dir`` (created at run start; nearest existing parent
    writable), ``model_dir`` (checked with model.gguf_file in ``validate()``)."""
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
        if self.choices or self.target:
            if value in self.choices:
                return
            if self.target and isinstance(value, str) and ":" in value:
                resolve_target(key, value, self.target)
                return
            one_of(key, value, list(self.choices), extra="module:Class" if self.target == "class" else
                   "module:function" if self.target else "")
        if self.path == "file":
            check_file(key, value)
        elif self.path == "out_dir":
            check_out_dir(key, value)

    def _check_number(self, key: str, v: float) -> None:
        bad = ((self.ge is not None and v < self.ge) or (self.gt is not None and v <= self.gt)
               or (self.le is not None and v > self.le) or (self.lt is not None and v >= self.lt))
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


def show(value: Any) -> str:
    """A value as a message shows it: its repr, shortened (a key may be given a whole file's worth)."""
    import reprlib

    r = reprlib.Repr()
    r.maxstring = r.maxother = 60
    return r.repr(value)


def one_of(key: str, value: Any, allowed: list, extra: str = "") -> None:
    """Raise unless ``value`` is one of ``allowed``; the fix lists them and the closest match."""
    if value in allowed:
        return
    names = [("null" if x is None else str(x)) for x in allowed]
    close = difflib.get_close_matches(str(value), names, n=1)
    fix = f"use one of {', '.join(names + ([extra] if extra else []))}"
    fix += f" (did you mean '{close[0]}'?)" if close else ""
    raise ConfigError(key, f"unknown value {show(value)}", fix)


def check_file(key: str, value: str) -> Path:
    """``value`` names an existing file this process can read."""
    p = Path(value)
    if not value.strip():
        raise ConfigError(key, "is an empty path", "give a file path, or null")
    if not p.exists():
        raise ConfigError(key, f"file not found: {p}", "give the path of an existing file")
    if not p.is_file():
        raise ConfigError(key, f"{p} is not a file", "give the path of a file, not a directory")
    try:
        with p.open("rb"):
            pass
    except OSError as e:
        raise ConfigError(key, f"cannot read {p} ({e.strerror})", "fix its permissions or give another file") from e
    return p


_WRITABLE: set[Path] = set()
"""Directories a probe could write to in this process (sweeps load many configs; failures are not cached)."""


def check_out_dir(key: str, value: str | os.PathLike) -> Path:
    """``value`` is an existing writable directory, or can be created: its nearest existing parent is a
    writable directory. Nothing is left behind (the probe directory is removed at once)."""
    p = Path(value)
    if not str(value).strip():
        raise ConfigError(key, "is an empty path", "give a directory path, or null for the default")
    anc = p
    while not anc.exists() and anc != anc.parent:
        anc = anc.parent
    if not anc.is_dir():
        raise ConfigError(key, f"{anc} exists and is not a directory", "choose a path not under a file")
    if anc in _WRITABLE:
        return p
    try:
        probe = tempfile.mkdtemp(prefix=".psrl-probe-", dir=anc)
        os.rmdir(probe)
        _WRITABLE.add(anc)
    except OSError as e:
        what = "the directory" if anc == p else f"its nearest existing parent {anc}"
        raise ConfigError(key, f"cannot write to {what} ({e.strerror or e})",
                          "choose a directory you can write to") from e
    return p


def finite(key: str, value: float) -> float:
    """NaN and infinities are never settings (YAML reads '.nan', the float parser 'nan' and '1e999')."""
    if not math.isfinite(value):
        raise ConfigError(key, f"must be a finite number, got {value}", "give a plain number")
    return value


_WEIGHTS = ("*.safetensors", "pytorch_model*.bin", "*.safetensors.index.json", "pytorch_model.bin.index.json")
_TOKENIZER = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def check_model(m: Any) -> None:
    """``model.path`` / ``model.gguf_file`` name something transformers can load offline.

    transformers takes a missing directory for a hub id and fails with a message about repo names;
    here the user learns which key is wrong and that psrl loads models from disk only.
    """
    if m.path is None:
        if m.gguf_file is not None:
            raise ConfigError("model.gguf_file", "is set but model.path is null",
                              "set model.path to the directory that holds the GGUF file")
        return
    if not m.path.strip():
        raise ConfigError("model.path", "is an empty path", "give a local model directory, or null for the built-in model")
    d = Path(m.path)
    if not d.exists():
        hint = (f" (psrl loads models offline; '{m.path}' looks like a Hugging Face hub id)"
                if not d.is_absolute() and m.path.count("/") == 1 else "")
        raise ConfigError("model.path", f"no such directory: {d}{hint}",
                          "download the model first (huggingface-cli download ORG/NAME --local-dir DIR) "
                          "and set model.path=DIR, or null for the built-in model")
    if not d.is_dir():
        fix = (f"set model.path={d.parent} model.gguf_file={d.name}" if d.suffix == ".gguf"
               else "give the model's directory, not a file")
        raise ConfigError("model.path", f"{d} is a file, not a directory", fix)
    try:
        names = {p.name for p in d.iterdir()}
    except OSError as e:
        raise ConfigError("model.path", f"cannot read {d} ({e.strerror})", "fix its permissions") from e
    if m.gguf_file is not None:
        g = d / m.gguf_file
        if not m.gguf_file.strip() or not g.is_file():
            found = sorted(n for n in names if n.endswith(".gguf"))
            raise ConfigError("model.gguf_file", f"no file {m.gguf_file!r} in {d}",
                              f"use one of {', '.join(found)}" if found else "give the name of a .gguf file in model.path")
        if importlib.util.find_spec("gguf") is None:
            raise ConfigError("model.gguf_file", "loading a GGUF file needs the 'gguf' package, which is not installed",
                              "pip install gguf, or use a safetensors model directory")
        return
    missing = []
    if "config.json" not in names:
        missing.append("config.json")
    if not any(next(d.glob(pat), None) for pat in _WEIGHTS):
        missing.append("weights (*.safetensors or pytorch_model*.bin)")
    if not names.intersection(_TOKENIZER):
        missing.append("a tokenizer (tokenizer.json or tokenizer_config.json)")
    if missing:
        gg = sorted(n for n in names if n.endswith(".gguf"))
        fix = (f"it holds {gg[0]}: set model.gguf_file={gg[0]}" if gg else
               "give a Hugging Face model directory (save_pretrained writes one; a run's final/ is one)")
        raise ConfigError("model.path", f"{d} is not a model directory: no {', no '.join(missing)}", fix)


def check_task(task_cfg: Any, seed: int = 0) -> type:
    """``task.name`` resolves to a class and ``task.kwargs`` fit its constructor (nothing is built)."""
    import inspect

    from psrl.tasks.registry import resolve_task

    cls = resolve_task(task_cfg.name)
    bad = [k for k in task_cfg.kwargs if not isinstance(k, str) or not k.isidentifier()]
    if bad:
        raise ConfigError("task.kwargs", f"keys must be argument names, got {bad[0]!r}",
                          "write task.kwargs as name: value pairs")
    try:
        sig = inspect.signature(cls)
    except (TypeError, ValueError):  # no introspectable signature: the constructor will tell
        return cls
    try:
        sig.bind(task_cfg, seed=seed, tokenizer=None, **task_cfg.kwargs)
    except TypeError as e:
        accepted = [n for n, p in sig.parameters.items() if n not in ("task_cfg", "seed", "tokenizer", "self")
                    and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        raise ConfigError("task.kwargs", f"{task_cfg.name} does not accept them ({e})",
                          f"use only {', '.join(accepted)}" if accepted else "remove task.kwargs") from e
    return cls
