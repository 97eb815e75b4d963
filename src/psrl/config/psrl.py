"""The ``psrl.*`` sections: staleness control and rollout coordination.

PSRL's own keys (shared/spec/psrl-config-surface.md), with PSRL's meanings and defaults. A key PSRL has
that does nothing on this project's machines says so in ``effect=`` (the fate table of the reference);
keys for PSRL's GPU infrastructure are in :data:`~psrl.config.compat.OUT_OF_SCOPE`, and renamed keys in
:data:`~psrl.config.compat.MOVED`. Each section's ``check()`` holds the rules between its keys.
"""

from __future__ import annotations

from dataclasses import dataclass

from psrl.config.adaptive import AdaptiveStalenessConfig
from psrl.config.deployment import CheckpointConfig, DeploymentConfig
from psrl.config.fields import _f, _sub
from psrl.config.rules import require


@dataclass(frozen=True)
class RedundantRolloutConfig:
    enable: bool = _f(False, "Master switch: the four sizes below act only when true (set them only then).")
    alg_global_batch_size: int | None = _f(
        None,
        "B: group entries one training step consumes (null: psrl.staleness_buffer_entries).",
        ge=1,
        fix="set it to the entries one step trains on (>= 1), or null for psrl.staleness_buffer_entries",
    )
    redundant_global_batch_size: int | None = _f(
        None, "B': entries each buffer holds, B' >= B; extra entries are passively aborted (null: B).", ge=1
    )
    alg_rollout_n: int | None = _f(
        None,
        "N: trajectories per group the algorithm needs (null: psrl.rollout_n).",
        ge=1,
        fix="set it to the trajectories per group the algorithm needs (>= 1), or null for psrl.rollout_n",
    )
    redundant_rollout_n: int | None = _f(
        None, "N': trajectories launched per group, N' >= N; the slowest N'-N are cancelled (null: N).", ge=1
    )

    def check(self) -> None:
        """The four sizes act only when ``enable`` is true, so setting one without it is a mistake."""
        for name in ("alg_global_batch_size", "redundant_global_batch_size", "alg_rollout_n", "redundant_rollout_n"):
            require(
                self.enable or getattr(self, name) is None,
                f"psrl.redundant_rollout.{name}",
                "is set but psrl.redundant_rollout.enable is false, so it would have no effect",
                "set psrl.redundant_rollout.enable=true, or remove it",
            )


@dataclass(frozen=True)
class GroupPostProcessConfig:
    enable: bool = _f(False, "Run a group filter on every completed group before it occupies a slot.")
    name: str | None = _f(
        None,
        "Filter name: 'dynamic_sampling_filter' (drop groups whose metric has zero std) or module:callable.",
        choices=("dynamic_sampling_filter",),
        target="callable",
    )

    def check(self, filter_metric: str | None) -> None:
        """An enabled filter needs a name; the dynamic sampling filter needs ``algorithm.filter_groups.metric``."""
        if not self.enable:
            return
        require(
            self.name is not None,
            "psrl.group_post_process.name",
            "is null but group_post_process.enable is true",
            "set name: dynamic_sampling_filter (or module:callable), or enable: false",
        )
        if self.name == "dynamic_sampling_filter":
            require(
                filter_metric is not None,
                "algorithm.filter_groups.metric",
                "dynamic_sampling_filter needs a metric",
                "set algorithm.filter_groups.metric to score, acc, seq_reward or seq_final_reward",
            )


@dataclass(frozen=True)
class ProactiveFilterConfig:
    method: str | None = _f(
        None,
        "What to do with the last RESERVED entries of a STUCK buffer: null | retry | truncate.",
        choices=(None, "retry", "truncate"),
    )
    threshold: int = _f(
        0,
        "Act when a STUCK buffer has at most this many RESERVED entries left. 0 (PSRL's "
        "default) never acts: a STUCK buffer always has at least one.",
        ge=0,
    )
    scope: str = _f(
        "window",
        "psrl's own key (not PSRL's): which STUCK buffers the filter acts on. window = every one in [T, T+eta] "
        "(as before this key); head = only buffer T, only while the trainer waits for it (after grace): it "
        "cuts only what holds the trainer up, and later, so less (docs/simulate.md).",
        choices=("window", "head"),
    )
    grace: float = _f(
        0.0,
        "psrl's own key (not PSRL's): scope head acts only once the trainer has waited this many seconds "
        "for buffer T (0: at once).",
        ge=0,
        fix="set psrl.proactive_filter_strategy.grace to seconds >= 0 (0: act as soon as the trainer waits)",
    )

    def check(self) -> None:
        """grace is read by scope head only, so setting it with scope window is a mistake."""
        require(
            self.grace == 0 or self.scope == "head",
            "psrl.proactive_filter_strategy.grace",
            f"is {self.grace} but psrl.proactive_filter_strategy.scope is {self.scope!r}, which has no grace",
            "set psrl.proactive_filter_strategy.scope=head, or remove grace",
        )


@dataclass(frozen=True)
class PartialRolloutConfig:
    enable: bool = _f(
        True,
        "At a weight sync, in-flight generations are interrupted and continue under the new weights, keeping "
        "their tokens (each token records its version); false: the instance lets them finish on the old weights.",
    )
    interrupt_as_prompt: bool = _f(
        False,
        "true: an interrupted request is continued as a new request whose prompt is the old context plus "
        "its tokens so far, routed again (it may land on another instance); false: the same request is "
        "paused and resumed on its instance.",
    )


@dataclass(frozen=True)
class RoutingConfig:
    method: str = _f(
        "request_num_balance",
        "Which instance gets a trajectory: random | round_robin | request_num_balance (fewest "
        "running) | throughput_optimal (largest marginal gain of a fitted decode-throughput model).",
        choices=("random", "round_robin", "request_num_balance", "throughput_optimal"),
    )
    cost_model_path: str | None = _f(
        None,
        "throughput_optimal: JSON cost model (psrl profile writes one); null: fitted online from the engines' "
        "own running-requests and tokens/s figures.",
        path="file",
    )
    request_budget: int = _f(
        1024,
        "Assumed tokens per request of throughput_optimal_with_budget.",
        ge=1,
        effect="only read by throughput_optimal_with_budget, which is not built here",
    )
    delta_throughput_threshold: float = _f(
        0.5,
        "throughput_optimal: skip an instance whose marginal gain has fallen below this fraction of its "
        "gain when idle (when every instance is below it, the best one still gets the request).",
        ge=0,
        le=1,
    )
    request_sort_indicator: str = _f(
        "small_id",
        "Order in which requests waiting at an instance are admitted: small_id (arrival) | short_length "
        "| long_length (context length).",
        choices=("small_id", "short_length", "long_length"),
    )
    candidate_sort_indicator: str = _f(
        "version",
        "Tie-break among equally good instances: version (newest weights first) | reserve_capability "
        "(most free sequence slots first).",
        choices=("version", "reserve_capability"),
    )
    enable_multi_priority_queue: bool = _f(
        False,
        "Multi-level queue: requests waiting at an instance are admitted by V_traj, older (more stale) first "
        "(before request_sort_indicator).",
    )
    enable_group_sticky: bool = _f(
        True, "All members of a group start on the instance its first member went to (while that instance has room)."
    )
    enable_trajectory_sticky: bool = _f(
        True, "Later turns of a trajectory go to the instance of its first turn; false: every turn is routed again."
    )
    max_concurrent_seqs_per_instance: int = _f(
        16,
        "Trajectories one instance serves at once (agent workers = this x instances); requests beyond it "
        "wait at the instance. PSRL's default 1024 is a GPU figure; 16 fits a CPU engine.",
        ge=1,
        fix="set psrl.routing_strategy.max_concurrent_seqs_per_instance to at least psrl.rollout_n, e.g. 8",
    )
    check_interval_in_ms: int = _f(
        500,
        "PSRL's routing-loop period.",
        ge=1,
        effect="psrl is event-driven: it routes when a request arrives, with no polling loop",
    )


@dataclass(frozen=True)
class SyncConfig:
    indicator: str = _f(
        "request_num",
        "status_based: what the instance's status is: request_num (running trajectories) | throughput "
        "(tokens/s) | kv_cache (KV-cache use, engines that report it: vllm).",
        choices=("request_num", "throughput", "kv_cache"),
    )
    threshold: float | None = _f(
        None,
        "status_based: pull when the indicator is below this (a count, tokens/s "
        "or a fraction); required by status_based.",
        ge=0,
    )
    check_req_before_sync: bool = _f(True, "Pull only when no request waits at the instance to be admitted.")
    seamless_train_version: int = _f(
        0,
        "While the newest version is <= this, instances do not pull (they serve as long as the staleness bound "
        "lets them), so the first steps' buffers fill without a sync pause.",
        ge=0,
    )


@dataclass(frozen=True)
class MigConfig:
    enable: bool = _f(False, "Migrate requests between instances to balance load (partial rollout keeps their tokens).")
    indicator: str = _f(
        "request_num",
        "Imbalance measure: request_num | throughput | kv_cache.",
        choices=("request_num", "throughput", "kv_cache"),
    )
    threshold: float | None = _f(
        None,
        "Start migrating when max/min of the indicator across instances exceeds "
        "this (e.g. 2.0); required when mig.enable.",
        ge=1,
    )
    stop_indicator: str = _f(
        "request_num",
        "Measure for stopping: request_num | throughput | kv_cache.",
        choices=("request_num", "throughput", "kv_cache"),
    )
    stop_threshold: float | None = _f(
        None, "Stop migrating once max/min of stop_indicator is at or below this (e.g. 1.2; null: mig.threshold).", ge=1
    )

    def check(self, partial_rollout: bool) -> None:
        """Migration needs partial rollout (``psrl.partial_rollout.enable``) and a start above its stop."""
        if not self.enable:
            return
        require(
            partial_rollout,
            "psrl.sync_and_mig_strategy.mig.enable",
            "migration continues requests on another instance, possibly at another version, which needs "
            "partial rollout",
            "set psrl.partial_rollout.enable=true, or mig.enable=false",
        )
        require(
            self.threshold is not None,
            "psrl.sync_and_mig_strategy.mig.threshold",
            "is null but mig.enable is true",
            "set it to the max/min ratio that starts a migration, e.g. 2.0",
        )
        stop = self.stop_threshold if self.stop_threshold is not None else self.threshold
        assert stop is not None and self.threshold is not None  # required just above
        require(
            stop <= self.threshold,
            "psrl.sync_and_mig_strategy.mig.stop_threshold",
            f"{stop} is above mig.threshold {self.threshold}: migration would stop before it started",
            "set it <= psrl.sync_and_mig_strategy.mig.threshold (e.g. 1.2 with threshold 2.0)",
        )


@dataclass(frozen=True)
class SyncAndMigConfig:
    method: str = _f(
        "greedy",
        "When an instance pulls new weights: greedy (as soon as they exist) | status_based "
        "(when sync.indicator drops below sync.threshold).",
        choices=("greedy", "status_based"),
    )
    check_interval_in_ms: int = _f(
        100,
        "PSRL's sync/migration loop period.",
        ge=1,
        effect="psrl is event-driven: instances re-check on every publish and every "
        "finished request, with no polling loop",
    )
    sync: SyncConfig = _sub(SyncConfig, "When an instance pulls.")
    mig: MigConfig = _sub(MigConfig, "Migration as load balancing (considered only in rounds where no sync fired).")

    def check(self, engine: str, partial_rollout: bool) -> None:
        """status_based needs a threshold; the kv_cache indicator needs an engine that reports it (``engine``:
        ``rollout.engine``); migration's own rules (``partial_rollout``: ``psrl.partial_rollout.enable``)."""
        sync, mig = self.sync, self.mig
        if self.method == "status_based":
            require(
                sync.threshold is not None,
                "psrl.sync_and_mig_strategy.sync.threshold",
                "is null but sync_and_mig_strategy.method is status_based",
                "set it to the level below which an instance pulls (e.g. 2 for request_num)",
            )
        uses_kv = (self.method == "status_based" and sync.indicator == "kv_cache") or (
            mig.enable and "kv_cache" in (mig.indicator, mig.stop_indicator)
        )
        require(
            not uses_kv or engine == "vllm",
            "psrl.sync_and_mig_strategy",
            f"reads the kv_cache indicator, which rollout.engine={engine} does not report",
            "use request_num or throughput, or rollout.engine=vllm",
        )
        mig.check(partial_rollout)


@dataclass(frozen=True)
class PsrlConfig:
    staleness: int = _f(
        0,
        "eta: maximum staleness, consumed_version - V_traj <= staleness for every trajectory; 0 = synchronous.",
        ge=0,
        fix="set psrl.staleness=0 for synchronous training, or a positive bound such as 2",
    )
    staleness_buffer_entries: int = _f(
        512,
        "Group entries per buffer: the training batch in prompts (B).",
        ge=1,
        fix="set psrl.staleness_buffer_entries to the entries a step trains on, e.g. 8",
    )
    rollout_n: int = _f(
        1,
        "Trajectories per group (N).",
        ge=1,
        fix="set psrl.rollout_n to the trajectories per prompt, e.g. 4 (1 = no group baseline)",
    )
    partial_rollout: PartialRolloutConfig = _sub(PartialRolloutConfig, "Partial rollout.")
    redundant_rollout: RedundantRolloutConfig = _sub(RedundantRolloutConfig, "Batch- and group-level redundancy.")
    routing_strategy: RoutingConfig = _sub(RoutingConfig, "Which rollout instance gets a request.")
    sync_and_mig_strategy: SyncAndMigConfig = _sub(
        SyncAndMigConfig, "When an instance pulls weights; when requests move."
    )
    proactive_filter_strategy: ProactiveFilterConfig = _sub(ProactiveFilterConfig, "Filter on RESERVED entries.")
    group_post_process: GroupPostProcessConfig = _sub(GroupPostProcessConfig, "Filter on OCCUPIED entries.")
    deployment: DeploymentConfig = _sub(DeploymentConfig, "Resource shape.")
    adaptive_staleness: AdaptiveStalenessConfig = _sub(
        AdaptiveStalenessConfig, "psrl's own: the bound of new reservations moved within psrl.staleness."
    )
    checkpoint: CheckpointConfig = _sub(CheckpointConfig, "Checkpoint format.")

    def check(self, engine: str, filter_metric: str | None) -> None:
        """The rules between ``psrl.*`` keys, then each section's own; ``engine`` is ``rollout.engine`` and
        ``filter_metric`` is ``algorithm.filter_groups.metric``, which the kv_cache indicator and the
        dynamic sampling filter depend on."""
        require(
            self.redundant_batch_size >= self.batch_size,
            "psrl.redundant_rollout.redundant_global_batch_size",
            f"redundant_global_batch_size ({self.redundant_batch_size}) < alg_global_batch_size ({self.batch_size})",
            "set it >= alg_global_batch_size, or leave it null for no batch-level redundancy",
        )
        require(
            self.redundant_group_size >= self.group_size,
            "psrl.redundant_rollout.redundant_rollout_n",
            f"redundant_rollout_n ({self.redundant_group_size}) < alg_rollout_n ({self.group_size})",
            "set it >= alg_rollout_n, or leave it null for no group-level redundancy",
        )
        self.redundant_rollout.check()
        n_inst, cap = self.deployment.n_rollout_instances, self.routing_strategy.max_concurrent_seqs_per_instance
        workers = n_inst * cap
        require(
            self.redundant_group_size <= workers,
            "psrl.routing_strategy.max_concurrent_seqs_per_instance",
            f"a group launches {self.redundant_group_size} trajectories but only {workers} agent workers exist "
            f"({n_inst} instances x {cap})",
            f"set psrl.routing_strategy.max_concurrent_seqs_per_instance >= {-(-self.redundant_group_size // n_inst)}, "
            "or lower psrl.rollout_n / psrl.redundant_rollout.redundant_rollout_n",
        )
        self.sync_and_mig_strategy.check(engine, self.partial_rollout.enable)
        self.proactive_filter_strategy.check()
        self.group_post_process.check(filter_metric)
        self.adaptive_staleness.check(self.staleness)

    # Derived values (B, B', N, N') -- computed, never written back.
    @property
    def batch_size(self) -> int:
        r = self.redundant_rollout
        return (r.enable and r.alg_global_batch_size) or self.staleness_buffer_entries

    @property
    def redundant_batch_size(self) -> int:
        r = self.redundant_rollout
        return (r.enable and r.redundant_global_batch_size) or self.batch_size

    @property
    def group_size(self) -> int:
        r = self.redundant_rollout
        return (r.enable and r.alg_rollout_n) or self.rollout_n

    @property
    def redundant_group_size(self) -> int:
        r = self.redundant_rollout
        return (r.enable and r.redundant_rollout_n) or self.group_size
