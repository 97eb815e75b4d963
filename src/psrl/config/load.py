"""Loading: a YAML file (or the built-in preset), dotted command-line overrides, each value coerced to
its key's type, then ``Config.validate()``. Every problem is a :class:`ConfigError` naming the key
(or the file); nothing is written or started."""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from pathlib import Path
from typing import Any

from psrl.config.compat import MOVED, NOT_BUILT, OUT_OF_SCOPE
from psrl.config.fields import yaml_key
from psrl.config.rules import INT_MAX, finite, show
from psrl.config.schema import Config
from psrl.errors import ConfigError

PRESET = Path(__file__).resolve().parent / "default.yaml"
"""The built-in default job (``psrl train`` with no config file): its own sizes, so it runs in minutes."""


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check/convert one YAML value against its annotated type (null only where the type is Optional)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [t for t in typing.get_args(tp) if t is not type(None)]
        return None if value is None else _coerce(value, args[0], key)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if value is None:  # an empty section ("trainer:" with nothing under it) means the defaults
            value = {}
        if not isinstance(value, dict):
            raise ConfigError(
                key,
                f"expected a mapping, got {show(value)}",
                f"write it as '{key}: {{...}}' or set its keys one by one ({key}.KEY=VALUE)",
            )
        return _build(tp, value, key)
    if value is None:
        raise ConfigError(
            key,
            "is null, but this key needs a value",
            f"set {key} (see docs/configuration.md), or remove it for the default",
        )
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(key, f"expected true/false, got {show(value)}", f"set {key}=true or {key}=false")
    if tp is int:
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(key, f"expected an integer, got {show(value)}", f"set {key} to a whole number")
        if abs(value) > INT_MAX:
            raise ConfigError(key, f"{value} is too large", f"set {key} to a value below 2**63")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads 2e-3 (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(key, f"expected a number, got {show(value)}", f"set {key} to a number")
        try:
            return finite(key, float(value))
        except OverflowError:  # an integer beyond float range
            raise ConfigError(key, f"{value} is too large", f"set {key} to a plain number") from None
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(key, f"expected a string, got {show(value)}", f"quote it: {key}='{value}'")
        return value
    if tp is dict or origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(key, f"expected a mapping, got {show(value)}", f"write it as '{key}: {{name: value}}'")
        return dict(value)
    if tp is list or origin is list:
        if isinstance(value, str):  # one file / one logger: "a" means ["a"]
            return [value]
        if not isinstance(value, list):
            raise ConfigError(key, f"expected a list, got {show(value)}", f"write it as '{key}: [a, b]'")
        return list(value)
    return value


def _build(cls: type, data: dict, prefix: str = "") -> Any:
    """An instance of the section ``cls`` from its YAML mapping (``prefix``: the section's dotted key)."""
    types_of = typing.get_type_hints(cls)
    by_key = {yaml_key(f): f for f in dataclasses.fields(cls)}
    kwargs = {}
    for k, v in data.items():
        full = f"{prefix}.{k}" if prefix else str(k)
        if full in MOVED:
            raise ConfigError(full, "this key has moved", f"use {MOVED[full]}")
        if full in OUT_OF_SCOPE:
            raise ConfigError(full, f"is a PSRL key that is out of scope here: {OUT_OF_SCOPE[full]}", "remove it")
        if isinstance(v, str) and (full, v) in NOT_BUILT:
            raise ConfigError(full, f"{v!r} is not built here: {NOT_BUILT[(full, v)]}", "choose another value")
        if k not in by_key:
            close = difflib.get_close_matches(str(k), list(by_key), n=1)
            fix = (
                f"did you mean '{(prefix + '.') if prefix else ''}{close[0]}'?"
                if close
                else (f"known keys here: {', '.join(sorted(by_key))}")
            )
            raise ConfigError(full, "unknown key", fix)
        f = by_key[k]
        kwargs[f.name] = _coerce(v, types_of[f.name], full)
    return cls(**kwargs)


def config_from_dict(data: dict) -> Config:
    """A :class:`Config` from plain data with YAML key names (:func:`config_to_dict`'s output, a run's
    ``config.yaml``), keys and types checked but not ``validate()``d: for a process handed a config its
    driver validated already."""
    return _build(Config, data)


def leaf_keys(cls: type = Config, prefix: str = "") -> dict[str, tuple[Any, dataclasses.Field]]:
    """Every leaf key as ``{dotted YAML key: (annotated type, dataclass field)}``: what the bad-input fuzzer
    and the unread-key test iterate, so a new key is covered the day it is added."""
    out: dict[str, tuple[Any, dataclasses.Field]] = {}
    types_of = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = f"{prefix}.{yaml_key(f)}" if prefix else yaml_key(f)
        if dataclasses.is_dataclass(types_of[f.name]):
            out.update(leaf_keys(types_of[f.name], key))
        else:
            out[key] = (types_of[f.name], f)
    return out


def config_to_dict(obj: Any) -> Any:
    """The config as plain data with YAML key names (what ``config.yaml`` in a run directory holds)."""
    if dataclasses.is_dataclass(obj):
        return {yaml_key(f): config_to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {k: config_to_dict(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [config_to_dict(v) for v in obj]
    return obj


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply ``a.b.c=value`` overrides (values parsed as YAML) to a nested dict, in place."""
    import yaml

    for item in overrides:
        if "=" not in item:
            raise ConfigError(item, "override is not key=value", f"write it as {item}=VALUE")
        key, _, raw = item.partition("=")
        key = key.strip()
        parts = key.split(".")
        if not all(parts):
            raise ConfigError(key or item, "override has an empty key part", "write it as section.key=VALUE")
        node = data
        for p in parts[:-1]:
            nxt = node.get(p)
            if nxt is None:
                nxt = node[p] = {}
            if not isinstance(nxt, dict):
                raise ConfigError(key, f"'{p}' is a value, not a section")
            node = nxt
        try:
            node[parts[-1]] = yaml.safe_load(raw)
        except yaml.YAMLError:
            node[parts[-1]] = raw
    return data


def _read_yaml(path: str | Path) -> dict:
    """The mapping in a YAML config file; every way it can be unreadable is a ConfigError naming the file."""
    import yaml

    p = Path(path)
    if not p.exists():
        raise ConfigError(str(path), "config file not found", "give an existing YAML file, or no file for the defaults")
    if not p.is_file():
        raise ConfigError(str(path), "is not a file", "give a YAML file (the directory's config.yaml, for a run)")
    try:
        loaded = yaml.safe_load(p.read_text(encoding="utf-8"))
    except OSError as e:
        raise ConfigError(str(path), f"cannot read the config file ({e.strerror})", "fix its permissions") from e
    except UnicodeDecodeError as e:
        raise ConfigError(str(path), f"is not UTF-8 text (byte {e.start})", "give a YAML text file") from e
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(str(path), f"is not valid YAML{where}: {problem}", "fix the YAML syntax there") from e
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise ConfigError(
            str(path),
            f"top level of the YAML file must be a mapping, got {type(loaded).__name__}",
            "write sections such as 'psrl:' and 'trainer:' at the top level",
        )
    return loaded


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Load YAML (the built-in default job, :data:`PRESET`, when ``path`` is None), apply overrides, validate.

    Keys a file leaves out take the schema's defaults, which are PSRL's (:data:`PSRL_DEFAULT_DIFFERS`
    lists the exceptions); the preset sets its own sizes so that ``psrl train`` alone runs in minutes.

    Nothing is written or started: every error is a :class:`ConfigError` naming the key (or the file).
    """
    data = _read_yaml(path if path is not None else PRESET)
    apply_overrides(data, overrides or [])
    return _build(Config, data).validate()
