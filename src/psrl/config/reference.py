"""The configuration reference (``docs/configuration.md``), generated from the schema's dataclasses:
each key's type, default, allowed values (its :class:`~psrl.config.fields.Rule` in words) and help, then
the fate of every key of PSRL's ``psrl:`` group. Regenerate with ``python -m psrl.config``."""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from typing import Any

from psrl.config.compat import MOVED, NOT_BUILT, OUT_OF_SCOPE, PSRL_DEFAULT_DIFFERS, PSRL_OWN
from psrl.config.fields import yaml_key
from psrl.config.load import PRESET, leaf_keys
from psrl.config.schema import Config


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [t for t in typing.get_args(tp) if t is not type(None)]
        return _type_name(args[0]) + " | null"
    return getattr(tp, "__name__", str(tp))


def allowed(f: dataclasses.Field, tp: Any) -> str:
    """What the reference says a key accepts: its :class:`~psrl.config.fields.Rule` in words (the rule
    ``validate()`` checks)."""
    text = "true | false" if tp is bool else f.metadata["rule"].describe()
    nullable = typing.get_origin(tp) in (typing.Union, types.UnionType)
    if nullable and "null" not in text.split(" | "):
        text = f"{text}; or null" if text else "null"
    return text


def _rows(cls: type, prefix: str) -> list[tuple[str, str, str, str, str]]:
    rows = []
    types_of = typing.get_type_hints(cls)
    inst = cls()
    for f in dataclasses.fields(cls):
        key = f"{prefix}.{yaml_key(f)}" if prefix else yaml_key(f)
        tp = types_of[f.name]
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            rows.extend(_rows(tp, key))
            continue
        default = getattr(inst, f.name)
        if default is None or isinstance(default, bool):
            shown = json.dumps(default)  # null, true, false
        else:
            shown = repr(default) if isinstance(default, (dict, list)) else str(default)
        rows.append((key, _type_name(tp), shown, allowed(f, tp), f.metadata.get("help", "")))
    return rows


def reference_markdown() -> str:
    """The configuration reference, generated from the schema's dataclasses."""
    lines = [
        "# Configuration reference",
        "",
        "Generated from `src/psrl/config/` by `python -m psrl.config > docs/configuration.md`;",
        "a test fails when this page and the code disagree. Set keys in a YAML file or on the",
        "command line as dotted overrides: `psrl train psrl.staleness=2 trainer.total_steps=10`.",
        "",
    ]
    for f in dataclasses.fields(Config):
        sect = yaml_key(f)
        lines += [
            f"## `{sect}` -- {f.metadata['help']}",
            "",
            "| key | type | default | allowed | meaning |",
            "|---|---|---|---|---|",
        ]
        for key, tp, default, ok, help in _rows(typing.get_type_hints(Config)[f.name], sect):
            cells = [f"`{key}`", tp, f"`{default}`", ok, help]
            lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")  # '|' would split a cell
        lines.append("")
    return "\n".join(lines + _fate_table())


def _fate_table() -> list[str]:
    """Every key of PSRL's ``psrl:`` group and what psrl does with it (spec/psrl-config-surface.md)."""
    rows = []
    for key, (_, f) in leaf_keys().items():
        if not key.startswith("psrl."):
            continue
        if "effect" in f.metadata:
            rows.append((key, "accepted, no effect", f.metadata["effect"]))
        elif key in PSRL_OWN:
            rows.append((key, "psrl's own (not PSRL's)", PSRL_OWN[key]))
        else:
            differs = PSRL_DEFAULT_DIFFERS.get(key)
            why = f"default differs from PSRL's {differs[0]}: {differs[1]}" if differs else "PSRL's meaning and default"
            rows.append((key, "built", why))
    rows += [(f"{k} = {v}", "rejected", why) for (k, v), why in NOT_BUILT.items()]
    rows += [
        (f"{k}.*" if k not in ("psrl.ps_mode", "psrl.colocate") else k, "rejected (out of scope)", why)
        for k, why in OUT_OF_SCOPE.items()
    ]
    rows += [(k, "removed", f"use {new}") for k, new in MOVED.items() if k.startswith("psrl.")]
    lines = [
        "## PSRL's keys and their fate",
        "",
        "Every key of PSRL's `psrl:` group: built with PSRL's meaning, accepted with no effect here (and why),",
        "or rejected at load with a message that says why; a removed name's message names its replacement.",
        'Keys psrl adds to the group that PSRL does not have say so ("psrl\'s own").',
        "Keys a YAML file leaves out take the defaults above; `psrl train` with no file runs the built-in",
        f"default job `src/psrl/config/{PRESET.name}`, which sets its own sizes.",
        "",
        "| key | fate | why |",
        "|---|---|---|",
    ]
    for key, fate, why in rows:
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in (f"`{key}`", fate, why)) + " |")
    lines.append("")
    return lines
