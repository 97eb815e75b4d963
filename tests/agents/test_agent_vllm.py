"""``task.name=agent`` on vLLM (``-m vllm``; run in a loopback-only network namespace): the endpoint's turns go
through the same token-in/token-out engine Protocol as on ``hf``; the staleness audit holds on every trajectory."""

import json

import pytest

from psrl.runtime.recorder import read_jsonl
from psrl.train_cli import main
from tests.conftest import TINY_MODEL
from tests.rollout.harness import check_bound

pytestmark = pytest.mark.vllm


def test_an_agent_trains_on_vllm_with_a_clean_audit(tmp_path, vllm_urls):
    rows = [
        {"prompt": [{"role": "user", "content": f"{i}+1?"}], "reward_model": {"ground_truth": str(i + 1)}}
        for i in range(8)
    ]
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run_dir = tmp_path / "run"
    args = [
        *TINY_MODEL,
        "rollout.engine=vllm",
        f"rollout.vllm.urls=[{','.join(vllm_urls)}]",
        "task.name=agent",
        "task.agent=tests.agents.agent_fns:tool_agent",
        f"data.train_files={data}",
        "data.max_prompt_length=1024",
        "data.max_response_length=16",
        "psrl.staleness=1",
        "psrl.rollout_n=2",
        "psrl.staleness_buffer_entries=4",
        "psrl.routing_strategy.max_concurrent_seqs_per_instance=8",
        "trainer.total_steps=3",
        "trainer.checkpoint_every=100",
        f"trainer.run_dir={run_dir}",
    ]
    assert main(args) == 0
    records = read_jsonl(run_dir / "trajectories.jsonl")
    assert check_bound(records, 1) == 3 * 4 * 2  # steps x groups (psrl.staleness_buffer_entries) x N
    assert all(r["response_len"] > 0 for r in records if r["status"] == "trained")
