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


def test_per_level_names_are_known_only_as_listed_patterns():
    """``divergence/ess@s<k>`` in the table stands for ``divergence/ess@s0``, ``@s1``, ...: a level needs digits, an
    unlisted base is unknown, a ``prefix/*`` family never covers a per-level key, the template is no key."""
    assert known("divergence/ess@s0") and known("divergence/kl@s12") and known("staleness/tokens@s3")
    assert not known("divergence/ess@s") and not known("divergence/ess@sx") and not known("divergence/ess@s-1")
    assert not known("divergence/nosuch@s1") and not known("staleness/reserves@s1")  # staleness/* is a family
    assert not known("divergence/ess@s<k>") and known("staleness/reserves") and known("val/pass@k")
