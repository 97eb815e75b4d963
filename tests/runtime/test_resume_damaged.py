"""Resuming from a damaged checkpoint is a one-line message naming the checkpoint, never a traceback
(issue #15); an intact ``checkpoint.old`` is used when ``checkpoint`` is damaged.

The property takes a real checkpoint (the real coordinator on fake engines and trainer, virtual
time), damages its files in any combination (deleted, emptied, truncated at any byte, overwritten
with text, or holding a well-formed pickle of the wrong shape), and resumes: either the run resumes
and trains on, or :class:`~psrl.errors.RunError` names the checkpoint directory and what to do.
"""

from __future__ import annotations

import atexit
import pickle
import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from psrl.errors import RunError
from psrl.rollout.fakes import FakeTrainer
from psrl.runtime.checkpoint import load_checkpoint
from psrl.runtime.recorder import read_jsonl
from psrl.train.launch import RankFailure
from tests.rollout.harness import config, run
from tests.runtime.test_checkpoint_resume import SaveAt, build

ALLOWED = {RunError: "psrl's own error naming the damaged checkpoint and the fix"}
"""The only exception types a resume may raise, with the reason."""

CFG = config(psrl__staleness=1)
CK_FILES = ("coordinator.pkl", "trainer.json")


def _template() -> Path:
    d = Path(tempfile.mkdtemp(prefix="psrl-ck-")) / "run"
    atexit.register(shutil.rmtree, d.parent, True)  # made at import (hypothesis' examples copy it): gone at exit
    d.mkdir()
    coord, rec, _ = build(CFG, d, FakeTrainer(train_time=0.5))
    run(coord, 2, SaveAt(2, d, rec, coord))
    rec.close()
    assert (d / "checkpoint" / "coordinator.pkl").exists()
    return d


TEMPLATE = _template()

WRONG_PICKLES = [
    pickle.dumps(x)
    for x in (
        None,
        [1, 2],
        {"version": 1},
        {"version": "x", "staleness": {}, "agents": {}, "offsets": {}},
        {"version": 2, "staleness": None, "agents": None, "offsets": {"metrics.jsonl": -5}},
        {"version": 2, "staleness": {"train_version": "?"}, "agents": {}, "offsets": {"nope.jsonl": 1}},
    )
]
# text garbage has no newline: protocol-0 GLOBAL opcodes need one, so damaged bytes cannot name an import
TEXT = st.text(st.characters(blacklist_characters="\n\r", blacklist_categories=("Cs",)), max_size=40)


@st.composite
def damage(draw) -> list[tuple[str, str, object]]:
    """A list of ``(file, how, arg)`` to apply to the checkpoint (and sometimes a damaged checkpoint.old)."""
    ops = draw(
        st.lists(
            st.tuples(
                st.sampled_from(CK_FILES + ("checkpoint.old/coordinator.pkl",)),
                st.sampled_from(["delete", "empty", "truncate", "text", "pickle", "zero"]),
                st.floats(0, 1),
            ),
            min_size=1,
            max_size=3,
        )
    )
    return [
        (f, how, draw(TEXT) if how == "text" else draw(st.sampled_from(WRONG_PICKLES)) if how == "pickle" else cut)
        for f, how, cut in ops
    ]


def apply(ops, run_dir: Path) -> None:
    for name, how, arg in ops:
        if name.startswith("checkpoint.old/"):
            if not (run_dir / "checkpoint.old").exists():
                shutil.copytree(run_dir / "checkpoint", run_dir / "checkpoint.old")
            p = run_dir / name
        else:
            p = run_dir / "checkpoint" / name
        if not p.exists():
            continue
        data = p.read_bytes()
        if how == "delete":
            p.unlink()
        elif how == "empty":
            p.write_bytes(b"")
        elif how == "truncate":
            p.write_bytes(data[: int(len(data) * arg)])
        elif how == "text":
            p.write_text(arg)
        elif how == "pickle":
            p.write_bytes(arg)
        elif how == "zero":
            k = int(len(data) * arg)
            p.write_bytes(data[:k] + b"\0" * (len(data) - k))


def check_resume(ops) -> None:
    d = Path(tempfile.mkdtemp(prefix="psrl-ck-")) / "run"
    shutil.copytree(TEMPLATE, d)
    apply(ops, d)
    try:
        coord, rec, ck = build(CFG, d, FakeTrainer(train_time=0.5))
    except tuple(ALLOWED) as e:
        assert "\n" not in str(e) and "checkpoint" in str(e) and "fix:" in str(e), str(e)
    else:  # resumed (from an intact checkpoint or checkpoint.old) or found none: it trains on
        run(coord, 4)
        rec.close()
        assert [m["step"] for m in read_jsonl(d / "metrics.jsonl")][-1] == 4
    finally:
        shutil.rmtree(d.parent)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=damage())
def test_a_damaged_checkpoint_resumes_or_says_why(ops):
    check_resume(ops)


@pytest.mark.slow
@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=damage())
def test_a_damaged_checkpoint_resumes_or_says_why_long(ops):
    check_resume(ops)


def test_an_intact_checkpoint_old_is_used_when_checkpoint_is_damaged(tmp_path):
    d = tmp_path / "run"
    shutil.copytree(TEMPLATE, d)
    shutil.copytree(d / "checkpoint", d / "checkpoint.old")
    (d / "checkpoint" / "coordinator.pkl").write_bytes(b"\x80\x04garbage")
    assert load_checkpoint(d)["dir"] == d / "checkpoint.old"


def test_a_damaged_checkpoint_names_its_directory(tmp_path):
    d = tmp_path / "run"
    shutil.copytree(TEMPLATE, d)
    (d / "checkpoint" / "coordinator.pkl").write_bytes(b"")
    with pytest.raises(RunError) as e:
        load_checkpoint(d)
    assert e.value.source == f"checkpoint {d / 'checkpoint'}" and "trainer.resume=false" in str(e.value)


@pytest.mark.slow
def test_psrl_train_on_a_damaged_trainer_checkpoint_is_one_line(tmp_path, monkeypatch, capsys):
    """The real trainer: a garbage trainer.pt makes psrl train exit 1 with one line naming the checkpoint."""
    from psrl.train_cli import main
    from tests.runtime.test_train_cli_e2e import TINY

    monkeypatch.setenv("PSRL_DEBUG", "0")
    args = TINY + [f"trainer.run_dir={tmp_path / 'run'}"]
    assert main(args + ["trainer.total_steps=2"]) == 0
    (tmp_path / "run" / "checkpoint" / "trainer.pt").write_bytes(b"PK\x03\x04 not a zip")
    capsys.readouterr()
    assert main(args + ["trainer.total_steps=3"]) == 1
    err = capsys.readouterr().err.strip()
    # its size no longer matches the manifest, so it is found unreadable before torch.load is tried
    assert err.startswith(f"psrl train: checkpoint {tmp_path / 'run' / 'checkpoint'}: cannot be read"), err
    assert "trainer.pt is" in err and "the manifest says" in err
    assert "\n" not in err


class _RanksFail(FakeTrainer):
    """A trainer whose restore fails the way ``how`` says: the rank died / did not start, or its load raised."""

    def __init__(self, how: str):
        super().__init__(train_time=0.5)
        self.how = how

    def load(self, directory):
        raise RankFailure(0, "died (exit code -9)" if self.how == "died" else "failed", "bad shard")


def test_a_rank_that_dies_during_resume_leaves_the_checkpoint_in_place(tmp_path):
    """A trainer that cannot run is not a damaged checkpoint: the error is raised and nothing is renamed (a
    failed Ray start once moved a good checkpoint aside as checkpoint.damaged and resumed from an older one)."""
    d = tmp_path / "run"
    shutil.copytree(TEMPLATE, d)
    with pytest.raises(RankFailure, match="died"):
        build(CFG, d, _RanksFail("died"))
    assert (d / "checkpoint" / "coordinator.pkl").exists() and not (d / "checkpoint.damaged").exists()


def test_a_rank_whose_load_raises_marks_the_checkpoint_damaged(tmp_path):
    d = tmp_path / "run"
    shutil.copytree(TEMPLATE, d)
    with pytest.raises(RunError, match="cannot be restored"):
        build(CFG, d, _RanksFail("failed"))
