"""The metric-name table: one name per metric, documented in one generated page."""

from dataclasses import fields
from pathlib import Path

import pytest

from psrl.metrics import INDEX, METRICS, checked, known, levels, markdown, unknown
from psrl.rollout.client.records import Counts, MemorySink
from psrl.runtime.recorder import RunRecorder, read_jsonl
from psrl.staleness import Stats

ROOT = Path(__file__).resolve().parents[1]


def test_docs_metrics_page_is_generated_from_the_table():
    """docs/metrics.md is exactly what `python -m psrl.metrics` prints (regenerate it when the table changes)."""
    assert (ROOT / "docs" / "metrics.md").read_text() == markdown()


def test_names_are_unique_and_families_match_their_members():
    names = [m.name for m in METRICS]
    assert len(names) == len(set(names))
    assert known("counts/generated") and known("reward/mean") and known("staleness/passive_aborts")
    assert not known("reward/nosuch") and not known("nosuch") and not known("counts/nosuch")
    assert not known("counts/") and not known("counts/*")


def test_families_list_what_their_writers_write():
    """counts/* is one key per Counts field, staleness/* one per integer Stats counter (rollout/*: the e2e run)."""
    family = {m.name: m.members for m in METRICS}
    assert family["counts/*"] == tuple(f.name for f in fields(Counts))
    assert family["staleness/*"] == tuple(k for k, v in Stats().as_dict().items() if isinstance(v, int))


def test_index_keys_are_listed_first():
    """step, version and time index every row: they are the table's first names."""
    assert tuple(m.name for m in METRICS[: len(INDEX)]) == INDEX == ("step", "version", "time")


@pytest.mark.parametrize("sink", ["recorder", "memory"])
def test_no_writer_emits_a_key_the_table_does_not_list(tmp_path, sink):
    """The run recorder and the memory sink refuse a row with an unlisted key (or without its index keys), naming
    the key and the fix, and write nothing; a listed row is written as it is."""
    out = RunRecorder(tmp_path) if sink == "recorder" else MemorySink()
    good = {"step": 1, "version": 1, "time": 0.5, "counts/generated": 4}
    for bad in ({**good, "reward/nosuch": 1.0}, {**good, "counts/nosuch": 1}, {"time": 0.5}):
        with pytest.raises(ValueError, match="nosuch|index key") as e:
            out.metric(bad)
        assert "psrl.metrics" in str(e.value) or "step and version" in str(e.value)
    out.metric(good)
    rows = read_jsonl(tmp_path / "metrics.jsonl") if sink == "recorder" else out.metrics
    assert rows == [good] and unknown(good) == [] and checked(good) is good
    if sink == "recorder":
        out.close()


def test_per_level_names_are_known_only_as_listed_patterns():
    """``divergence/ess@s<k>`` in the table stands for ``divergence/ess@s0``, ``@s1``, ...: a level needs digits, an
    unlisted base is unknown, a ``prefix/*`` family never covers a per-level key, the template is no key."""
    assert known("divergence/ess@s0") and known("divergence/kl@s12") and known("staleness/tokens@s3")
    assert not known("divergence/ess@s") and not known("divergence/ess@sx") and not known("divergence/ess@s-1")
    assert not known("divergence/nosuch@s1") and not known("staleness/reserves@s1")  # staleness/* is a family
    assert not known("divergence/ess@s<k>") and known("staleness/reserves") and known("val/pass@k")


def test_levels_reads_one_per_level_metric_of_a_row():
    row = {"divergence/ess": 0.9, "divergence/ess@s0": 1.0, "divergence/ess@s3": 0.8, "divergence/m2@s3": 0.1}
    assert levels(row, "divergence/ess") == {0: 1.0, 3: 0.8}
    assert levels({"divergence/ess@sx": 1.0}, "divergence/ess") == {} and levels(row, "staleness/tokens") == {}
