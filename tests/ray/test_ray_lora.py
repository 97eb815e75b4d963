"""LoRA with ``runtime.backend=ray`` (issue #36): the ranks are Ray actors, the ``hf`` engines live in Ray actors and
get each version through the object store. Synchronous, so every step's tokens come from the version just
published: the engines' recorded log-probs equal the ranks' merged forward (``engine/logprob_mismatch_max`` < 1e-5
on every step), every step's version is the adapter alone, and the audit is clean.

What it proves and what not: the engine actors build their model from the config, and the run's base is
the warm-started model, which reaches them only in the first version (base + adapter); a base not applied would
show as a large mismatch. The built-in task gives the tiny model no reward spread in 3 steps, so the adapter's
gradient is zero and it stays the initial one (B = 0): a moving adapter on Ray is not checked here (the dataset
task, whose rewards do spread, does not start in a Ray engine actor: it builds its task without the data section).
Runs in a loopback-only network namespace, as the other Ray checks do."""

from __future__ import annotations

import pytest

from psrl.runtime.recorder import read_jsonl
from tests.ray.test_ray_ranks import _loopback_only
from tests.rollout.harness import check_bound
from tests.runtime.test_train_cli_e2e import TINY
from tests.runtime.test_train_lora import LORA

pytestmark = [pytest.mark.ray]


@pytest.mark.timeout(900)  # 2 rank actors and 2 engine actors on a shared 2-core box
def test_a_lora_run_on_ray_serves_what_it_trains_after_every_update(tmp_path):
    run_dir = tmp_path / "run"
    args = [*TINY, *LORA, f"trainer.run_dir={run_dir}"]  # the built-in task (a Ray engine actor builds its task
    # without the data section, so task.name=dataset does not start there)
    args += ["psrl.deployment.train_ngpus_per_node=2", "runtime.backend=ray", "trainer.total_steps=3"]
    out = _loopback_only(["-m", "psrl.cli", "train", *args])
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    rows = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "engine/mismatch_tokens" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["engine/mismatch_tokens"] > 0 for r in rows)
    worst = max(r["engine/logprob_mismatch_max"] for r in rows)
    print(f"Ray, 2 ranks, hf engine actors: max engine/logprob_mismatch_max {worst:.2e}")
    assert worst < 1e-5
    from transformers import AutoModelForCausalLM

    final = AutoModelForCausalLM.from_pretrained(run_dir / "final", local_files_only=True)
    whole = sum(t.numel() * t.element_size() for t in final.state_dict().values())
    assert all(0 < r["weights/bytes"] < 0.2 * whole for r in rows)
    assert check_bound(read_jsonl(run_dir / "trajectories.jsonl"), 0) == 3 * 2 * 2
