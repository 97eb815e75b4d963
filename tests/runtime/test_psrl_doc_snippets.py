"""PSRL's own documentation, as a user would paste it (issue #11 acceptance).

The YAML snippets below are copied verbatim from PSRL's documentation (``lhy101/psrl_doc_preview``,
``docs/design/*.md``; the page is named in each case). Each in-scope snippet is written to a file
and ``psrl train FILE`` runs 2 steps on it, with only the sizes overridden to fit a 2-core CPU (the
tiny built-in model, 2 groups of 2, 2 instances); the staleness audit of ``trajectories.jsonl`` is
clean. Out-of-scope snippets stop at load with their reason; removed names point to the new one.
"""

from __future__ import annotations

import pytest

from psrl.config import MOVED, OUT_OF_SCOPE, ConfigError, load_config
from psrl.runtime.recorder import read_jsonl
from psrl.train_cli import main
from tests.rollout.harness import check_bound

SIZES = [
    "model.n_layer=1",
    "model.n_embd=32",
    "model.n_head=2",
    "trainer.warm_start_steps=0",
    "trainer.total_steps=2",
    "trainer.checkpoint_every=0",
    "task.tool_latency_median=0.01",
    "psrl.staleness=1",
    "psrl.staleness_buffer_entries=2",
    "psrl.rollout_n=2",
    "psrl.deployment.n_rollout_instances=2",
    "psrl.routing_strategy.max_concurrent_seqs_per_instance=4",
]
"""What fits this machine (PSRL's defaults are 512 prompts per buffer on GPU servers)."""

IN_SCOPE = {
    "architecture.md: deployment": (
        """
psrl:
  deployment:
    train_nnodes: 2                          # Training nodes
    train_ngpus_per_node: 8                  # GPUs per training node
    n_rollout_instances: 2                   # Number of rollout instances
    rollout_nnodes_per_instance: 1           # Nodes per rollout instance
    rollout_ngpus_per_node_per_instance: 8   # GPUs per node within each instance (TP size)
""",
        # the trainer's shape sized to this machine as SIZES sizes the rest: one node (the local launcher), 2 CPU ranks
        ["psrl.deployment.train_nnodes=1", "psrl.deployment.train_ngpus_per_node=2"],
    ),
    "flexible_rollout.md: partial rollout": (
        """
psrl:
  partial_rollout:
    enable: true
    interrupt_as_prompt: false
""",
        [],
    ),
    "flexible_rollout.md: redundant rollout": (
        """
psrl:
  redundant_rollout:
    enable: true
    # Batch-level: launch 80 prompts, keep the first 64 that fully complete.
    alg_global_batch_size: 64
    redundant_global_batch_size: 80
    # Group-level: launch 10 responses per prompt, keep the first 8 per prompt.
    alg_rollout_n: 8
    redundant_rollout_n: 10
""",
        [
            "psrl.redundant_rollout.alg_global_batch_size=2",
            "psrl.redundant_rollout.redundant_global_batch_size=3",
            "psrl.redundant_rollout.alg_rollout_n=2",
            "psrl.redundant_rollout.redundant_rollout_n=3",
        ],
    ),
    "flexible_rollout.md: throughput_optimal": (
        """
psrl:
  routing_strategy:
    method: throughput_optimal
""",
        [],
    ),
    "flexible_rollout.md: multi-level queue": (
        """
psrl:
  routing_strategy:
    method: throughput_optimal
    enable_multi_priority_queue: true
""",
        [],
    ),
    "flexible_rollout.md: sync (with the 'sync:' level of PSRL's config reference)": (
        """
psrl:
  sync_and_mig_strategy:
    sync:
      indicator: request_num
      threshold: 2
      check_req_before_sync: true
""",
        ["psrl.sync_and_mig_strategy.method=status_based"],
    ),
    "flexible_rollout.md: migration": (
        """
psrl:
  sync_and_mig_strategy:
    mig:
      enable: true
      indicator: request_num
      threshold: 2.0       # Trigger when one instance has 2x the load of another
      stop_indicator: request_num
      stop_threshold: 1.2  # Stop when imbalance drops below 1.2x
""",
        [],
    ),
    "staleness_control.md: group sampling": (
        """
psrl:
  rollout_n: 8   # >1 enables group sampling (GRPO/DAPO/GSPO style)
""",
        [],
    ),
    "staleness_control.md: dynamic sampling filter": (
        """
psrl:
  group_post_process:
    enable: true
    name: dynamic_sampling_filter
algorithm:
  filter_groups:
    metric: score   # or acc / seq_reward / seq_final_reward
""",
        [
            "task.name=dataset",
            "task.reward=tests.tasks.reward_fns:length_parity",
            "data.max_prompt_length=16",
            "data.max_response_length=4",
            "data.train_files={rows}",
        ],
    ),
    "staleness_control.md: proactive filter": (
        """
psrl:
  proactive_filter_strategy:
    method: retry        # null | retry | truncate
    threshold: 4
""",
        [],
    ),
}

OUT_OF_SCOPE_SNIPPETS = {
    "flexible_rollout.md: kv_transfer": (
        """
psrl:
  routing_strategy:
    kv_transfer:
      enable: true
      transfer_mode: sync
""",
        "psrl.routing_strategy.kv_transfer",
    ),
    "kv_cache.md: lmcache": (
        """
psrl:
  lmcache:
    enable: true
    offload_size_gb: 40.0
    chunk_size: 256
    save_decode_cache: true
    clear_on_weight_update: true
    enable_async_loading: true
    cache_policy: LRU
    backend: cpu
""",
        "psrl.lmcache",
    ),
    "kv_cache.md: lmcache p2p": (
        """
psrl:
  lmcache:
    enable: true
    enable_p2p: true
    p2p_transfer_channel: nixl
    controller_base_port: 9000
""",
        "psrl.lmcache",
    ),
    "parameter_server.md: broadcast_init": (
        """
psrl:
  broadcast_init:
    enabled: true        # rank-0 reads disk, everyone else gets bytes over NIXL
    algorithm: binary_tree   # only algorithm currently shipped
""",
        "psrl.broadcast_init",
    ),
    "resource_elasticity.md: tms": (
        """
psrl:
  tms:
    range: all
    enable_cuda_graph: true
    enable_nixl: false
""",
        "psrl.tms",
    ),
    "router_tito.md: SMG gateway": (
        """
psrl:
  rollout_gateway:
    enable: true
    server_max_concurrency: 256
    use_distributed_post: false
    post_actor_num_per_node: 8

  agentic_rl:
    sticky_session: false

  routing_strategy:
    method: round_robin
    candidate_sort_indicator: version
    enable_group_sampling_on_multi_instances: true
""",
        "psrl.rollout_gateway",
    ),
}

FLAT_SYNC = """
psrl:
  sync_and_mig_strategy:
    indicator: request_num
    threshold: 2
    check_req_before_sync: true
"""
"""flexible_rollout.md's sync snippet verbatim: its keys lack the 'sync:' level that PSRL's config reference
(and psrl.yaml) give them, so it names the nested key."""


@pytest.mark.parametrize("name", list(IN_SCOPE))
def test_in_scope_snippet_runs_psrl_train_with_a_clean_audit(tmp_path, name):
    """The dynamic sampling filter drops every group of an untrained tiny model on the agentic task (all
    rewards 0), so that snippet runs on a dataset whose reward varies within a group (answer-length parity)."""
    import json

    text, extra = IN_SCOPE[name]
    path = tmp_path / "psrl.yaml"
    path.write_text(text)
    rows = tmp_path / "rows.jsonl"
    rows.write_text(
        "".join(
            json.dumps({"prompt": f"{a}+1=", "reward_model": {"ground_truth": str(a + 1)}}) + "\n" for a in range(8)
        )
    )
    extra = [e.format(rows=rows) for e in extra]
    run_dir = tmp_path / "run"
    args = [str(path)] + SIZES + extra + [f"trainer.run_dir={run_dir}"]
    cfg = load_config(str(path), args[1:])
    assert main(args) == 0
    assert [m["step"] for m in read_jsonl(run_dir / "metrics.jsonl")] == [1, 2]
    trajs = read_jsonl(run_dir / "trajectories.jsonl")
    assert check_bound(trajs, cfg.psrl.staleness) == 2 * cfg.psrl.batch_size * cfg.psrl.group_size


@pytest.mark.parametrize("name", list(OUT_OF_SCOPE_SNIPPETS))
def test_out_of_scope_snippet_is_rejected_with_its_reason(tmp_path, name):
    text, key = OUT_OF_SCOPE_SNIPPETS[name]
    path = tmp_path / "psrl.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config(str(path))
    assert err.value.key == key and OUT_OF_SCOPE[key] in str(err.value)


def test_the_flat_sync_snippet_names_the_nested_keys(tmp_path):
    path = tmp_path / "psrl.yaml"
    path.write_text(FLAT_SYNC)
    with pytest.raises(ConfigError, match=r"psrl\.sync_and_mig_strategy\.sync\.indicator"):
        load_config(str(path))


@pytest.mark.parametrize("key", sorted(OUT_OF_SCOPE))
def test_every_out_of_scope_key_gives_its_message(key):
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"{key}=true"])
    assert err.value.key == key and "out of scope" in str(err.value) and OUT_OF_SCOPE[key] in str(err.value)


@pytest.mark.parametrize("old", sorted(k for k in MOVED if k.startswith("psrl.")))
def test_every_removed_name_points_to_its_new_one(old):
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"{old}=1"])
    assert err.value.key == old and MOVED[old].split()[0] in str(err.value)
    new = MOVED[old].split()[0].rstrip("*").rstrip(".")
    assert any(k.startswith(new) for k in _leaves()), new


@pytest.mark.parametrize(
    "method, value",
    [
        ("psrl.routing_strategy.method", "throughput_optimal_with_budget"),
        ("psrl.routing_strategy.method", "cache_aware"),
        ("psrl.sync_and_mig_strategy.sync.indicator", "hypothesis_test"),
    ],
)
def test_psrl_values_not_built_here_say_why(method, value):
    with pytest.raises(ConfigError, match="not built here"):
        load_config(None, [f"{method}={value}"])


def test_the_advanced_example_stops_at_its_first_out_of_scope_key():
    """configuration.md's 'Advanced 7B FSDP Config' overrides: ps_mode is PSRL's GPU transport."""
    over = [
        "psrl.staleness=2",
        "psrl.staleness_buffer_entries=64",
        "psrl.ps_mode=nixl_cpu",
        "psrl.rollout_n=8",
        "psrl.deployment.n_rollout_instances=16",
        "psrl.deployment.train_nnodes=2",
        "psrl.partial_rollout.enable=True",
        "psrl.redundant_rollout.enable=True",
        "psrl.routing_strategy.method=throughput_optimal",
        "psrl.routing_strategy.enable_multi_priority_queue=True",
        "psrl.sync_and_mig_strategy.method=status_based",
        "psrl.sync_and_mig_strategy.sync.indicator=kv_cache",
        "psrl.sync_and_mig_strategy.mig.enable=True",
        "psrl.proactive_filter_strategy.method=retry",
        "psrl.proactive_filter_strategy.threshold=4",
    ]
    with pytest.raises(ConfigError) as err:
        load_config(None, over)
    assert err.value.key == "psrl.ps_mode"
    with pytest.raises(ConfigError) as err:  # without it: the kv_cache indicator needs an engine that reports KV use
        load_config(
            None,
            [o for o in over if "ps_mode" not in o]
            + ["psrl.sync_and_mig_strategy.sync.threshold=0.5", "psrl.sync_and_mig_strategy.mig.threshold=2"],
        )
    assert "kv_cache" in str(err.value) and "rollout.engine=vllm" in str(err.value)


def _leaves() -> list[str]:
    from psrl.config import leaf_keys

    return list(leaf_keys())
