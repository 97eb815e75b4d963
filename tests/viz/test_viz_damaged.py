"""``psrl viz`` on damaged run directories: it draws what is intact and says what it skipped, or says in
one line why it cannot draw -- never a traceback (issue #15).

A run killed mid-write leaves a truncated last line; copies get cut; people edit files. The property
draws a real buffer timeline, then damages each file (missing, empty, truncated at any byte, garbage
lines of any shape inserted), and runs the command with ``PSRL_DEBUG=1`` so that anything but psrl's
own error would surface as an exception here.
"""

from __future__ import annotations

import atexit
import json
import random
import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from psrl.errors import PsrlError
from psrl.runtime.recorder import EventLog
from psrl.staleness import StalenessManager
from psrl.viz.cli import load_run
from psrl.viz.cli import main as viz_main
from psrl.viz.events import read_valid
from tests.viz.test_events import drive

ALLOWED = {PsrlError: "psrl's own one-line error (e.g. a directory with neither file)"}
"""The only exception types psrl viz may raise here, with the reason."""

FILES = ("events.jsonl", "trajectories.jsonl")


def _template() -> Path:
    d = Path(tempfile.mkdtemp(prefix="psrl-viz-")) / "run"
    atexit.register(shutil.rmtree, d.parent, True)  # made at import (hypothesis' examples copy it): gone at exit
    d.mkdir()
    log = EventLog(d / "events.jsonl", clock=iter(range(10**6)).__next__)
    m = StalenessManager(staleness=1, batch_size=2, group_size=1, on_event=log)
    drive(m, random.Random(0), 150)
    log.close()
    (d / "trajectories.jsonl").write_text(
        "".join(json.dumps({"v_traj": v, "consumed_version": v + s}) + "\n" for v in range(5) for s in range(2))
    )
    return d


TEMPLATE = _template()

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=6,
)
FIELDS = ["t", "kind", "buffer", "reserved_buffer", "entry", "v_traj", "consumed_version"]
RECORDS = st.dictionaries(
    st.sampled_from(FIELDS),
    st.one_of(JSON_VALUES, st.sampled_from(["reserve", "occupy", "consume", "abort", 0, 1, -1, 10**12, 1e308])),
    max_size=5,
)
GARBAGE_LINE = st.one_of(
    RECORDS.map(lambda r: json.dumps(r, allow_nan=True)),
    JSON_VALUES.map(lambda v: json.dumps(v, allow_nan=True)),
    st.text(max_size=30),
).map(lambda t: t.encode("utf-8", "surrogatepass")) | st.binary(max_size=30)


@st.composite
def damage(draw) -> dict:
    """Per file: ('keep'|'missing'|'empty'|'truncate', cut fraction, [(line index, garbage line)])."""
    out = {}
    for name in FILES:
        kind = draw(st.sampled_from(["keep", "missing", "empty", "truncate"]))
        out[name] = (
            kind,
            draw(st.floats(0, 1)),
            draw(st.lists(st.tuples(st.integers(0, 400), GARBAGE_LINE), max_size=3)),
        )
    return out


def apply(spec: dict, run_dir: Path) -> None:
    for name, (kind, cut, garbage) in spec.items():
        p = run_dir / name
        if kind == "missing":
            p.unlink()
            continue
        data = p.read_bytes()
        if kind == "empty":
            data = b""
        lines = data.split(b"\n")
        for at, g in garbage:
            lines.insert(min(at, len(lines)), g.replace(b"\n", b" "))
        data = b"\n".join(lines)
        if kind == "truncate":
            data = data[: int(len(data) * cut)]
        p.write_bytes(data)


def _damaged_copy(spec: dict, parent: Path | None = None) -> Path:
    """A damaged copy of the template, ``parent/run`` (a new temporary directory that the caller removes if None:
    hypothesis' examples cannot take ``tmp_path``)."""
    d = (parent or Path(tempfile.mkdtemp(prefix="psrl-viz-"))) / "run"
    shutil.copytree(TEMPLATE, d)
    apply(spec, d)
    return d


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=damage())
def test_damaged_files_load_what_is_intact(spec):
    """Reading (no drawing): intact lines give a timeline, damaged ones are counted in one warning line."""
    d = _damaged_copy(spec)
    warnings: list[str] = []
    try:
        timeline, stale, _ = load_run(d, warn=warnings.append)
    except tuple(ALLOWED) as e:
        assert "\n" not in str(e) and all(spec[f][0] == "missing" for f in FILES), str(e)
    else:
        assert len(warnings) <= 1 and all("\n" not in w for w in warnings)
        assert all(isinstance(b, int) for b in timeline) and all(isinstance(s, int) for s in stale)
    finally:
        shutil.rmtree(d.parent)


def _run_viz(spec: dict, monkeypatch, capsys) -> None:
    d = _damaged_copy(spec)
    monkeypatch.setenv("PSRL_DEBUG", "1")  # anything but psrl's own error raises here
    try:
        assert viz_main([str(d), "--out", str(d / "t.png")]) == 0
        assert (d / "t.png").read_bytes()[:4] == b"\x89PNG"
    except tuple(ALLOWED) as e:
        assert "\n" not in str(e)
    finally:
        shutil.rmtree(d.parent)
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) <= 1 and "Traceback" not in err


@settings(
    max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)
@given(spec=damage())
def test_viz_draws_damaged_runs_or_says_why(spec, monkeypatch, capsys):
    _run_viz(spec, monkeypatch, capsys)


@pytest.mark.slow
@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)
@given(spec=damage())
def test_viz_draws_damaged_runs_or_says_why_long(spec, monkeypatch, capsys):
    _run_viz(spec, monkeypatch, capsys)


def test_a_directory_without_run_files_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PSRL_DEBUG", "0")
    assert viz_main([str(tmp_path)]) == 1
    err = capsys.readouterr().err.strip()
    assert "holds neither events.jsonl nor trajectories.jsonl" in err and "\n" not in err
    assert viz_main([str(tmp_path / "missing")]) == 1
    assert "is not a directory" in capsys.readouterr().err


def test_a_truncated_last_line_is_skipped_and_reported(tmp_path, capsys):
    """A run killed mid-write: the timeline is drawn from the intact lines, one warning names the line."""
    d = _damaged_copy({"events.jsonl": ("keep", 1.0, []), "trajectories.jsonl": ("keep", 1.0, [])}, tmp_path)
    n = len((d / "events.jsonl").read_text().splitlines())
    with (d / "events.jsonl").open("a") as fh:
        fh.write('{"t": 3.5, "kind": "occ')
    assert viz_main([str(d), "--out", str(tmp_path / "t.png")]) == 0
    err = capsys.readouterr().err.strip()
    assert (
        err == f"psrl viz: skipped 1 damaged line(s), first: {d / 'events.jsonl'}:{n + 1}: not JSON "
        "(Unterminated string starting at)"
    )


def test_a_number_too_long_to_read_is_a_damaged_line(tmp_path):
    """A line JSON cannot turn into a value for another reason than its syntax (an integer past Python's
    4300-digit conversion limit) is reported like any damaged line, not raised."""
    p = tmp_path / "events.jsonl"
    p.write_text('{"t": 1.0, "kind": "reserve", "buffer": 0}\n{"t": ' + "1" * 5000 + "}\n")
    good, bad = read_valid(p, {"t": (int, float)})
    assert len(good) == 1 and len(bad) == 1 and bad[0].startswith(f"{p}:2: not JSON (Exceeds the limit")


def test_an_unwritable_out_path_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PSRL_DEBUG", "0")
    assert viz_main([str(TEMPLATE), "--out", "/proc/nope/t.png"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("psrl viz: --out /proc/nope/t.png: cannot write the PNG") and "\n" not in err


def test_moves_of_the_adaptive_bound_are_read_as_moves_not_damage(tmp_path, capsys):
    """``EventLog.bound`` lines (psrl.adaptive_staleness) sit among the core's events: viz returns them as
    moves, draws them, leaves the buffer timeline as it was and reports nothing damaged."""
    from psrl.runtime.adaptive import Move

    d = _damaged_copy({"events.jsonl": ("keep", 1.0, []), "trajectories.jsonl": ("keep", 1.0, [])}, tmp_path)
    before, _, no_moves = load_run(d, warn=pytest.fail)
    log = EventLog(d / "events.jsonl", clock=iter(range(10**6, 2 * 10**6)).__next__)
    log.bound(Move(step=4, old=1, new=2, reason="ess 0.97 >= 0.9"))
    log.bound(Move(step=6, old=2, new=1, reason="kl 0.2 > 0.1"))
    log.close()
    after, _, moves = load_run(d, warn=pytest.fail)
    assert no_moves == [] and after == before
    assert [(m["kind"], m["step"], m["old"], m["new"]) for m in moves] == [
        ("staleness_bound", 4, 1, 2),
        ("staleness_bound", 6, 2, 1),
    ]
    assert moves[0]["t"] < moves[1]["t"] and moves[1]["reason"] == "kl 0.2 > 0.1"
    assert viz_main([str(d), "--out", str(tmp_path / "t.png")]) == 0
    assert capsys.readouterr().err == ""
