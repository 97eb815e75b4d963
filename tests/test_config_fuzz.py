"""Property: any value for any key of the typed config loads, or fails with psrl's own error naming a key.

The key list comes from :func:`psrl.config.leaf_keys`, so a key is fuzzed the day it is added. Values
are drawn from everything a user (or a broken script) can write: wrong types, zero, negative and huge
numbers, NaN and infinities, empty and odd strings, ``module:attr`` names, missing, unreadable and
unwritable paths, and each key's own choices -- for one key or a random pair, as command-line
overrides or as a YAML file. Each runs the config-loading path of ``psrl train``
(:func:`psrl.train_cli.prepare`) and of ``psrl simulate`` (:func:`psrl.sim.cli.prepare`) from an empty
working directory, which must stay empty: nothing is written before the run starts.

The default suite draws a bounded number of examples; ``-m slow`` runs a longer profile.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import shutil
import tempfile
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from psrl.config import Config, leaf_keys
from psrl.errors import ConfigError

ALLOWED = {
    ConfigError: "psrl's own error for a bad value; it must name a key (checked below)",
}
"""The only exception types a config load may raise, with the reason each is allowed."""

KEYS = leaf_keys()
SECTIONS = {k.rsplit(".", i)[0] for k in KEYS for i in range(1, k.count(".") + 1)}

_FIXTURES = Path(tempfile.mkdtemp(prefix="psrl-fuzz-"))
atexit.register(shutil.rmtree, _FIXTURES, True)  # made at import (hypothesis' examples name its files): gone at exit
(_FIXTURES / "adir").mkdir()
(_FIXTURES / "afile").write_text("x")
(_FIXTURES / "trace.jsonl").write_text(
    "".join(json.dumps({"uid": f"g0-{i}", "group": "g0", "gen_seconds": 1.0 + i}) + "\n" for i in range(4))
)
(_FIXTURES / "damaged.jsonl").write_text('{"gen_seconds": 1.0}\n{"gen_sec\n\xff\n')
(_FIXTURES / "model").mkdir()
(_FIXTURES / "model" / "config.json").write_text("{}")
PATHS = [
    str(_FIXTURES / n)
    for n in ("adir", "afile", "trace.jsonl", "damaged.jsonl", "model", "missing/x", "afile/below-a-file")
] + ["/proc/nope", "/nonexistent", "/dev/null", "relative/dir", "~", ".", "", " ", "HuggingFaceTB/SmolLM2-135M"]
TARGETS = [
    "psrl.tasks.arith:ArithTask",
    "psrl.algo.filters:DynamicSamplingFilter",
    "json:loads",
    "os:path",
    "os:sep",
    "no_such_module_xyz:X",
    ":",
    "a:",
    ":b",
    ".relative:x",
    "psrl.tasks.arith:",
    "json:loads.x",
]
# no ':' in free text: a random module name must not import something with side effects at load
TEXT = st.text(st.characters(blacklist_characters=":", blacklist_categories=("Cs",)), max_size=12)

NUMBERS = st.one_of(
    st.sampled_from([0, -1, 1, 2, 2**31, 2**63, -(2**63) - 1, 10**30, 0.5, -0.5, 1e-300, 1e308]),
    st.integers(-(10**6), 10**6),
    st.floats(allow_nan=True, allow_infinity=True),
)
COMMON = [None, True, "x", [1], {"a": 1}]
BY_TYPE = {
    int: [0, -1, 2**63, -(10**30), 0.5, float("nan"), "1e3"],
    float: [0, -1, -0.5, 1e308, float("nan"), float("inf"), "1e999", "nan", 10**400],
    str: ["", " ", "ünï", 1, "/proc/nope"],
    bool: [0, "yes", "null"],
    dict: [{}, {1: 2}, {"": 1}, {"max_value": -1}, "a=1"],
}


def nasty(key: str) -> list:
    """The values every key meets in the default suite: some of every type, and for a key of its type
    (or rule) the edge values: zero, negative, huge, non-finite, empty, paths and module:attr names."""
    tp, f = KEYS[key]
    base = next((t for t in BY_TYPE if t is tp or t in getattr(tp, "__args__", ())), str)
    rule = f.metadata["rule"]
    out = COMMON + BY_TYPE[base]
    if rule.path or any(w in key for w in ("path", "file", "dir", "trace")):
        out = out + PATHS
    if rule.target or key.endswith(".name"):
        out = out + TARGETS
    return out + [c for c in rule.choices] + [str(c).upper() for c in rule.choices if c is not None]


def values_for(key: str) -> st.SearchStrategy:
    """What may land in ``key``: its own choices and anything of any type."""
    rule = KEYS[key][1].metadata["rule"]
    own = [c for c in rule.choices] + [str(c).upper() for c in rule.choices if c is not None]
    return st.one_of(
        st.sampled_from(own + nasty(key)),
        st.none(),
        st.booleans(),
        NUMBERS,
        TEXT,
        st.lists(st.integers(), max_size=2),
        st.dictionaries(TEXT, st.one_of(NUMBERS, TEXT), max_size=2),
    )


FORMS = st.sampled_from(["overrides", "raw", "file"])


@st.composite
def pairs(draw) -> tuple[str, dict]:
    """``(form, {key: value, key2: value2})``: a random pair of keys with random values."""
    k1 = draw(st.sampled_from(sorted(KEYS)))
    k2 = draw(st.sampled_from(sorted(set(KEYS) - {k1})))
    form = draw(FORMS)
    if form == "raw":  # whatever text a user types after '=', parsed as YAML by the loader
        return form, {k: draw(st.one_of(TEXT, st.sampled_from(PATHS + TARGETS))) for k in (k1, k2)}
    return form, {k1: draw(values_for(k1)), k2: draw(values_for(k2))}


def _args(form: str, values: dict) -> list[str]:
    if form == "raw":
        return [f"{k}={v}" for k, v in values.items()]
    if form == "overrides":
        return [
            f"{k}={yaml.safe_dump(v, default_flow_style=True, width=10**6).strip().removesuffix('...').strip()}"
            for k, v in values.items()
        ]
    nested: dict = {}
    for k, v in values.items():
        node = nested
        *parents, leaf = k.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = v
    f = _FIXTURES / "fuzz.yaml"
    f.write_text(yaml.safe_dump(nested))
    return [str(f)]


def _load_train(args: list[str]):
    from psrl.train_cli import prepare

    return prepare(args)


def _load_simulate(args: list[str]):
    from psrl.sim.cli import build_parser, prepare

    return prepare(build_parser().parse_args(args))


WORKDIR = _FIXTURES / "cwd"
WORKDIR.mkdir()


def check_loads_or_names_a_key(form: str, values: dict, loaders=(_load_train, _load_simulate)) -> None:
    """Each loader returns or raises an ALLOWED error with a one-line message naming a key; nothing is written."""
    args = _args(form, values)
    for load in loaders:
        with contextlib.chdir(WORKDIR):
            try:
                load(args)
            except tuple(ALLOWED) as e:
                assert "\n" not in str(e), str(e)
                assert (
                    e.key in KEYS
                    or e.key in SECTIONS
                    or any(k.startswith(e.key) or e.key.startswith(k) for k in values)
                ), (e.key, str(e))
        assert list(WORKDIR.iterdir()) == [], f"{load.__name__} wrote before the run: {list(WORKDIR.iterdir())}"


@pytest.mark.parametrize("key", sorted(KEYS))
def test_each_key_with_its_edge_values(key):
    """Default suite: every key meets each of its edge values (enumerated: a sample could miss one) through
    psrl train's loading path, as a command-line override."""
    for value in nasty(key):
        check_loads_or_names_a_key("overrides", {key: value}, loaders=(_load_train,))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pairs())
def test_random_pairs_load_or_name_a_key(case):
    """Default suite: random pairs of keys with random values, through psrl train and psrl simulate."""
    check_loads_or_names_a_key(*case)


@pytest.mark.slow
@settings(max_examples=4000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pairs())
def test_random_pairs_load_or_name_a_key_long(case):
    check_loads_or_names_a_key(*case)


@pytest.mark.slow
@pytest.mark.parametrize("key", sorted(KEYS))
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), form=FORMS)
def test_each_key_with_random_values_long(key, data, form):
    value = data.draw(values_for(key) if form != "raw" else st.one_of(TEXT, st.sampled_from(PATHS + TARGETS)))
    check_loads_or_names_a_key(form, {key: value})


def test_every_key_is_fuzzed_and_documented():
    """The fuzzer's key list is the config's, and every key states its allowed values in the reference."""
    from psrl.config import allowed

    assert set(KEYS) and all(k.split(".")[0] in {f for f in Config.__dataclass_fields__} for k in KEYS)
    for key, (tp, f) in KEYS.items():
        assert allowed(f, tp).strip(), f"{key} has no Rule text: give its _f(...) a range, choices or note"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(key=st.text(max_size=20), value=st.text(max_size=20))
def test_any_key_text_loads_or_names_it(key, value):
    """Keys are user text too: unknown, empty, with dots, spaces or line breaks -- one line naming it."""
    with contextlib.chdir(WORKDIR):
        try:
            _load_train([f"{key}={value}"])
        except tuple(ALLOWED) as e:
            assert "\n" not in str(e) and "\r" not in str(e), str(e)
    assert list(WORKDIR.iterdir()) == []
