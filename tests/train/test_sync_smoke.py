"""CI smoke test of synchronous training (``psrl.staleness=0``, the coordinator's own loop): with a fixed seed
the training reward rises (issue #3)."""

from psrl.config import load_config
from psrl.runtime.local import run


def test_synchronous_training_reward_rises_with_fixed_seed(tmp_path):
    """tool_arith (single-digit operands, short warm start): mean reward of the last steps > first steps."""
    cfg = load_config(
        None,
        [
            "trainer.lr=0.0005",
            "trainer.warm_start_steps=300",
            "task.kwargs={max_value: 9}",
            "model.device=cpu",
            "psrl.staleness=0",
            "task.tool_latency_median=0",
            "trainer.total_steps=40",
            "trainer.checkpoint_every=0",
        ],
    )
    h = run(cfg, tmp_path / "run", log=lambda _: None)
    assert max(r["staleness/max"] for r in h) == 0
    r = [m["reward/mean"] for m in h]
    assert sum(r[-8:]) / 8 > sum(r[:8]) / 8 + 0.05
