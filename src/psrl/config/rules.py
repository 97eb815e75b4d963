"""The checks a key's :class:`~psrl.config.fields.Rule` and the sections' ``check()`` methods call.

Each raises :class:`ConfigError` naming the key and the fix: a value among the allowed ones, a
finite number, an existing file, a writable output directory (nothing is written: it is probed with
a temporary directory that is removed at once, because ``os.access`` says yes to root on ``/proc``),
a model directory transformers can load offline, a task class whose constructor takes
``task.kwargs``.

Stdlib only, so loading a config never pulls torch in.
"""

from __future__ import annotations

import difflib
import importlib.util
import math
import os
import tempfile
from pathlib import Path
from typing import Any

from psrl.errors import ConfigError

__all__ = ["require", "one_of", "finite", "show", "check_file", "check_out_dir", "check_model", "check_task"]

INT_MAX = 2**63 - 1
"""Integers are handed to torch and numpy: anything beyond int64 cannot be a sensible setting."""


def require(ok: bool, key: str, problem: str, fix: str = "") -> None:
    """Raise :class:`ConfigError` naming ``key`` unless ``ok``: the form of every rule between keys."""
    if not ok:
        raise ConfigError(key, problem, fix)


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
        raise ConfigError(
            key, f"cannot write to {what} ({e.strerror or e})", "choose a directory you can write to"
        ) from e
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
            raise ConfigError(
                "model.gguf_file",
                "is set but model.path is null",
                "set model.path to the directory that holds the GGUF file",
            )
        return
    if not m.path.strip():
        raise ConfigError(
            "model.path", "is an empty path", "give a local model directory, or null for the built-in model"
        )
    d = Path(m.path)
    if not d.exists():
        hint = (
            f" (psrl loads models offline; '{m.path}' looks like a Hugging Face hub id)"
            if not d.is_absolute() and m.path.count("/") == 1
            else ""
        )
        raise ConfigError(
            "model.path",
            f"no such directory: {d}{hint}",
            "download the model first (huggingface-cli download ORG/NAME --local-dir DIR) "
            "and set model.path=DIR, or null for the built-in model",
        )
    if not d.is_dir():
        fix = (
            f"set model.path={d.parent} model.gguf_file={d.name}"
            if d.suffix == ".gguf"
            else "give the model's directory, not a file"
        )
        raise ConfigError("model.path", f"{d} is a file, not a directory", fix)
    try:
        names = {p.name for p in d.iterdir()}
    except OSError as e:
        raise ConfigError("model.path", f"cannot read {d} ({e.strerror})", "fix its permissions") from e
    if m.gguf_file is not None:
        g = d / m.gguf_file
        if not m.gguf_file.strip() or not g.is_file():
            found = sorted(n for n in names if n.endswith(".gguf"))
            raise ConfigError(
                "model.gguf_file",
                f"no file {m.gguf_file!r} in {d}",
                f"use one of {', '.join(found)}" if found else "give the name of a .gguf file in model.path",
            )
        if importlib.util.find_spec("gguf") is None:
            raise ConfigError(
                "model.gguf_file",
                "loading a GGUF file needs the 'gguf' package, which is not installed",
                "pip install gguf, or use a safetensors model directory",
            )
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
        fix = (
            f"it holds {gg[0]}: set model.gguf_file={gg[0]}"
            if gg
            else "give a Hugging Face model directory (save_pretrained writes one; a run's final/ is one)"
        )
        raise ConfigError("model.path", f"{d} is not a model directory: no {', no '.join(missing)}", fix)


def check_task(task_cfg: Any, seed: int = 0) -> type:
    """``task.name`` resolves to a class and ``task.kwargs`` fit its constructor (nothing is built)."""
    import inspect

    from psrl.tasks.registry import resolve_task

    cls = resolve_task(task_cfg.name)
    bad = [k for k in task_cfg.kwargs if not isinstance(k, str) or not k.isidentifier()]
    if bad:
        raise ConfigError(
            "task.kwargs", f"keys must be argument names, got {bad[0]!r}", "write task.kwargs as name: value pairs"
        )
    try:
        sig = inspect.signature(cls)
    except (TypeError, ValueError):  # no introspectable signature: the constructor will tell
        return cls
    try:
        sig.bind(task_cfg, seed=seed, tokenizer=None, **task_cfg.kwargs)
    except TypeError as e:
        accepted = [
            n
            for n, p in sig.parameters.items()
            if n not in ("task_cfg", "seed", "tokenizer", "self")
            and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        ]
        raise ConfigError(
            "task.kwargs",
            f"{task_cfg.name} does not accept them ({e})",
            f"use only {', '.join(accepted)}" if accepted else "remove task.kwargs",
        ) from e
    return cls
