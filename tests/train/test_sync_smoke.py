"""CI smoke test of the synchronous loop: with a fixed seed the training reward rises (issue #3)."""

from psrl.config import load_config
from psrl.runtime.sync_loop import run_sync


def test_sync_loop_reward_rises_with_fixed_seed():
    """tool_arith (single-digit operands, short warm start): mean reward of the last steps > first steps."""
    cfg = load_config(None, ["trainer.lr=0.0005", "trainer.warm_start_steps=300", "task.kwargs={max_value: 9}",
                             "model.device=cpu"])
    h = run_sync(cfg, steps=40, log=lambda _: None)
    r = [m["reward/mean"] for m in h]
    assert sum(r[-8:]) / 8 > sum(r[:8]) / 8 + 0.05
