"""The metric-name table: one name per metric, documented in one generated page."""

from pathlib import Path

from psrl.metrics import METRICS, known, markdown

ROOT = Path(__file__).resolve().parents[1]


def test_docs_metrics_page_is_generated_from_the_table():
    """docs/metrics.md is exactly what `python -m psrl.metrics` prints (regenerate it when the table changes)."""
    assert (ROOT / "docs" / "metrics.md").read_text() == markdown()


def test_names_are_unique_and_families_match_their_members():
    names = [m.name for m in METRICS]
    assert len(names) == len(set(names))
    assert known("counts/generated") and known("reward/mean")
    assert not known("reward/nosuch") and not known("nosuch")
