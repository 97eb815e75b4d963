"""``psrl train`` with ``model.lora_rank > 0`` (issue #36), synchronous so that every step's tokens come from the
version the trainer just published: at 1 rank (versions in memory) and 2 ranks (versions as files), after every
update the ``hf`` engines' recorded log-probs equal the ranks' recomputation (``engine/logprob_mismatch_max`` below
1e-5 on every step: the adapter served is the adapter trained, the failure of verl #7495 would show here), every
step's version is the adapter (``weights/bytes``), the audit is clean, ``final/`` loads with transformers alone and
``final/adapter/`` with peft on the run's base; the checkpoint resumes at the other world size and its engines serve
what the ranks train from the first step after the resume (issue #36 item 4; before, engines copied the driver's
policy under the resumed version and loaded nothing: the base without the adapter)."""

from __future__ import annotations

import pytest
import torch

from psrl.runtime.recorder import read_jsonl
from psrl.train_cli import main
from tests.rollout.harness import check_bound
from tests.runtime.test_train_cli_e2e import TINY

LORA = ["model.lora_rank=4", "model.lora_alpha=8", "psrl.staleness=0", "trainer.lr=0.01"]
DATA = [  # rewards that differ within a group (answer-length parity): advantages, and so the adapter, move
    "task.name=dataset",
    "task.reward=tests.tasks.reward_fns:length_parity",
    "data.max_prompt_length=16",
    "data.max_response_length=4",
]


@pytest.mark.parametrize("world", [1, 2])
def test_a_lora_run_serves_what_it_trains_after_every_update(tmp_path, world):
    import json

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    rows = tmp_path / "rows.jsonl"
    rows.write_text(
        "".join(
            json.dumps({"prompt": f"{a}+1=", "reward_model": {"ground_truth": str(a + 1)}}) + "\n" for a in range(8)
        )
    )
    run_dir = tmp_path / "run"
    args = TINY + LORA + DATA + [f"data.train_files={rows}", f"trainer.run_dir={run_dir}"]
    args += [f"psrl.deployment.train_ngpus_per_node={world}"]
    assert main(args + ["trainer.total_steps=3"]) == 0
    rows = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "engine/mismatch_tokens" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["engine/mismatch_tokens"] > 0 for r in rows)  # every step: tokens of the version just published
    assert max(r["engine/logprob_mismatch_max"] for r in rows) < 1e-5
    assert any(r["train/grad_norm"] > 0 for r in rows)  # the adapter did move
    final = AutoModelForCausalLM.from_pretrained(run_dir / "final", local_files_only=True)
    whole = sum(t.numel() * t.element_size() for t in final.state_dict().values())
    assert all(0 < r["weights/bytes"] < 0.2 * whole for r in rows)
    assert check_bound(read_jsonl(run_dir / "trajectories.jsonl"), 0) == 3 * 2 * 2
    assert (run_dir / "final" / "psrl_version.txt").read_text().strip() == "3"
    assert (run_dir / "final" / "adapter" / "adapter_config.json").exists()
    assert isinstance(PeftModel.from_pretrained(final, run_dir / "final" / "adapter"), PeftModel)

    # the checkpoint (the adapter and its AdamW state, DCP) continues at the other world size; the engines start from
    # the base and load the resumed version (it carries the base), so the first steps after the resume (tokens of
    # the restored trajectories and new ones) and those after them serve what the ranks train
    other = [a for a in args if not a.startswith("psrl.deployment")] + [
        f"psrl.deployment.train_ngpus_per_node={3 - world}"
    ]
    assert main(other + ["trainer.total_steps=5"]) == 0
    rows = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "engine/mismatch_tokens" in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert all(r["engine/mismatch_tokens"] > 0 for r in rows[3:])
    assert max(r["engine/logprob_mismatch_max"] for r in rows[3:]) < 1e-5
