"""``psrl viz`` of a short real run draws the divergence metrics: ESS, M2 and KL against step, ESS against
staleness level (issue 23)."""

from __future__ import annotations

import matplotlib.pyplot as plt

from psrl.runtime.recorder import read_jsonl
from psrl.train_cli import main as train
from psrl.viz.cli import main as viz_main
from psrl.viz.curves import curves_figure, ess_by_level
from tests.runtime.test_train_cli_e2e import TINY as TINY_RUN

TINY = [*TINY_RUN, "psrl.staleness=1", "trainer.total_steps=3"]


def _texts(fig) -> set[str]:
    """Every legend label, axis label and title of the figure (twin axes included)."""
    out = set()
    for ax in fig.axes:
        out |= {ax.get_xlabel(), ax.get_ylabel(), ax.get_title()}
        legend = ax.get_legend()
        if legend is not None:
            out |= {t.get_text() for t in legend.get_texts()}
    return out


def test_curves_of_a_short_run_name_the_divergence_metrics(tmp_path):
    run_dir = tmp_path / "run"
    assert train(TINY + [f"trainer.run_dir={run_dir}"]) == 0
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert all({"divergence/ess", "divergence/m2", "divergence/kl"} <= set(r) for r in rows if "reward/mean" in r)
    levels = ess_by_level(rows)
    assert levels and all(len(v) >= 1 for v in levels.values())
    fig = curves_figure(run_dir)
    try:
        texts = _texts(fig)
        assert {"divergence/ess", "divergence/m2", "divergence/kl", "divergence/ess@s<k>, mean over steps"} <= texts
        assert "staleness/bound" in texts  # the bound in force (psrl.staleness, or the adaptive controller's)
        by_level = next(ax for ax in fig.axes if ax.get_title() == "ESS per staleness level")
        assert by_level.get_xlabel().startswith("staleness") and by_level.lines
        assert sorted({x for line in by_level.lines for x in line.get_xdata()}) == sorted(levels)
    finally:
        plt.close(fig)
    assert viz_main([str(run_dir)]) == 0
    assert (run_dir / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
