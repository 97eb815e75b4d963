import dataclasses

from psrl.config.adaptive import AdaptiveStalenessConfig

MOVED = {
    "sim.trigger_parameter_sync_step": "sim.verl.trigger_parameter_sync_step",
    # head scope is in psrl train now: the simulator reads psrl's own keys (one name, one owner)
    "sim.proactive": "psrl.proactive_filter_strategy.scope and psrl.proactive_filter_strategy.grace",
    "sim.proactive.scope": "psrl.proactive_filter_strategy.scope",
    "sim.proactive.grace": "psrl.proactive_filter_strategy.grace",
    "psrl.num_rollout_instances": "psrl.deployment.n_rollout_instances",
    "psrl.max_concurrent_per_instance": "psrl.routing_strategy.max_concurrent_seqs_per_instance",
    "psrl.router": "psrl.routing_strategy.method",
    "psrl.sync_strategy": "psrl.sync_and_mig_strategy.method (request_num is now method=status_based with "
    "sync.indicator=request_num)",
    "psrl.sync_request_threshold": "psrl.sync_and_mig_strategy.sync.threshold (with method=status_based)",
    "psrl.partial_rollout.migration": "psrl.sync_and_mig_strategy.mig.* for migration as load balancing, or "
    "psrl.partial_rollout.interrupt_as_prompt=true to re-route interrupted requests "
    "at a sync",
    "psrl.runtime": "runtime.backend",
    "psrl.ray_address": "runtime.ray_address",
    "psrl.reward_retries": "task.reward_retries",
    # PSRL's flexible-rollout page writes these without 'sync:'; its config reference (and psrl.yaml) nests them.
    "psrl.sync_and_mig_strategy.indicator": "psrl.sync_and_mig_strategy.sync.indicator",
    "psrl.sync_and_mig_strategy.threshold": "psrl.sync_and_mig_strategy.sync.threshold",
    "psrl.sync_and_mig_strategy.check_req_before_sync": "psrl.sync_and_mig_strategy.sync.check_req_before_sync",
}
"""Keys that were renamed or removed: the old name is rejected with the new one in the message."""
_GPU = "needs PSRL's GPU infrastructure, which this project does not run"
OUT_OF_SCOPE = {
    "psrl.ps_mode": f"the parameter-server transport (cpu_ref / NIXL) {_GPU}; weights go through psrl.weights (the ranks' files, or memory at one rank with hf engines)",
    "psrl.nixl": f"NIXL RDMA weight transfer {_GPU}",
    "psrl.lmcache": f"LMCache KV offloading {_GPU}",
    "psrl.tms": f"the torch memory saver (TMS) {_GPU}",
    "psrl.routing_strategy.kv_transfer": f"KV transfer between instances goes through LMCache, which {_GPU}",
    "psrl.routing_strategy.cache_aware_policy": "tunes the SMG gateway's cache_aware router, which is not built here",
    "psrl.deployment.elastic_rm": f"elastic generative reward models {_GPU}",
    "psrl.deployment.heterogeneous_rollout": f"per-instance GPU shapes {_GPU}",
    "psrl.colocate": "rollout and training share no GPU set here (PSRL itself rejects colocate: true)",
    "psrl.status_collection": "engine status is read from each engine when needed (Engine.load()), not pushed on a timer",
    "psrl.rollout_gateway": f"the SMG rollout gateway {_GPU}",
    "psrl.broadcast_init": f"NIXL weight broadcast {_GPU}",
}
"""``psrl.*`` keys of PSRL that only make sense on its GPU infrastructure: rejected with a message that
says why, never silently ignored (spec/psrl-config-surface.md)."""
NOT_BUILT = {
    (
        "psrl.routing_strategy.method",
        "throughput_optimal_with_budget",
    ): "needs a per-request length prediction the engines do not give; use throughput_optimal",
    (
        "psrl.routing_strategy.method",
        "cache_aware",
    ): "needs prefix-cache (KV event) data from the engines, which they do not report; group and trajectory "
    "stickiness (enable_group_sticky, enable_trajectory_sticky) keep prefixes on one instance",
    (
        "psrl.sync_and_mig_strategy.sync.indicator",
        "hypothesis_test",
    ): "estimating a sync's benefit is not built; use request_num, throughput or kv_cache",
}
"""PSRL values psrl does not build: rejected with the reason (checked before the key's choices)."""
PSRL_DEFAULT_DIFFERS = {
    "psrl.routing_strategy.max_concurrent_seqs_per_instance": (
        "1024",
        "1024 sequences per engine is a GPU figure: a CPU engine would decode them one slow batch at a time",
    ),
}
"""Schema defaults that are not PSRL's, and why (every other ``psrl.*`` default is PSRL's)."""
_ADAPTIVE = "psrl's controller of the staleness bound (docs/staleness.md); PSRL's bound is fixed"
PSRL_OWN = {
    "psrl.proactive_filter_strategy.scope": "PSRL's filter has no choice of scope; head (act only on "
    "the buffer the trainer waits for) is psrl's, and window, the default, is what the filter did before",
    "psrl.proactive_filter_strategy.grace": "read by scope head only",
    **{f"psrl.adaptive_staleness.{f.name}": _ADAPTIVE for f in dataclasses.fields(AdaptiveStalenessConfig)},
}
"""``psrl.*`` keys that are psrl's own, not PSRL's: the fate table says so instead of "PSRL's meaning"."""
