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

__all__ = [
    "Config",
    "ConfigError",
    "load_config",
    "apply_overrides",
    "config_to_dict",
    "reference_markdown",
]


class ConfigError(ValueError):
    """A configuration value is wrong. The message names the dotted key and how to fix it."""

    def __init__(self, key: str, problem: str, fix: str = ""):
        self.key = key
        msg = f"config key '{key}': {problem}"
        if fix:
            msg += f" -- fix: {fix}"
        super().__init__(msg)


def _f(default: Any, help: str, key: str | None = None, **kw: Any) -> Any:
    """A config field with its help text (and optional YAML name when it is a Python keyword)."""
    meta = {"help": help}
    if key is not None:
        meta["key"] = key
    if isinstance(default, (list, dict)) or dataclasses.is_dataclass(default):
        factory = default if callable(default) and not dataclasses.is_dataclass(default) else None
        if factory is None:
            value = default
            return field(default_factory=lambda: _copy(value), metadata=meta, **kw)
        return field(default_factory=factory, metadata=meta, **kw)
    return field(default=default, metadata=meta, **kw)


def _copy(value: Any) -> Any:
    import copy

    return copy.deepcopy(value)


def _sub(cls: type, help: str) -> Any:
    return field(default_factory=cls, metadata={"help": help})


# --------------------------------------------------------------------------- psrl.*


@dataclass
class RedundantRolloutConfig:
    alg_global_batch_size: Optional[int] = _f(
        None, "B: group entries one training step consumes (default psrl.staleness_buffer_entries)."
    )
    redundant_global_batch_size: Optional[int] = _f(
        None, "B': entries each buffer holds, B' >= B; extra entries are passively aborted (default B)."
    )
    alg_rollout_n: Optional[int] = _f(
        None, "N: trajectories per group the algorithm needs (default psrl.rollout_n)."
    )
    redundant_rollout_n: Optional[int] = _f(
        None, "N': trajectories launched per group, N' >= N; the slowest N'-N are cancelled (default N)."
    )


@dataclass
class GroupPostProcessConfig:
    enable: bool = _f(False, "Run a group filter on every completed group before it occupies a slot.")
    name: Optional[str] = _f(
        None, "Filter name: 'dynamic_sampling_filter' (drop groups whose metric has zero std) or module:callable."
    )


@dataclass
class ProactiveFilterConfig:
    method: Optional[str] = _f(
        None, "What to do with the last RESERVED entries of a STUCK buffer: null | retry | truncate."
    )
    threshold: int = _f(4, "Act when a STUCK buffer has at most this many RESERVED entries left.")


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
    staleness: int = _f(2, "eta: maximum staleness, consumed_version - V_traj <= staleness for every trajectory.")
    staleness_buffer_entries: int = _f(8, "Group entries per buffer (B) unless redundant_rollout overrides it.")
    rollout_n: int = _f(4, "Trajectories per group (N) unless redundant_rollout overrides it.")
    redundant_rollout: RedundantRolloutConfig = _sub(RedundantRolloutConfig, "Batch- and group-level redundancy.")
    group_post_process: GroupPostProcessConfig = _sub(GroupPostProcessConfig, "Filter on OCCUPIED entries.")
    proactive_filter_strategy: ProactiveFilterConfig = _sub(ProactiveFilterConfig, "Filter on RESERVED entries.")
    partial_rollout: PartialRolloutConfig = _sub(PartialRolloutConfig, "Partial rollout and migration.")
    num_rollout_instances: int = _f(2, "Rollout instances, each with its own weights and version.")
    max_concurrent_per_instance: int = _f(8, "Trajectories one rollout instance generates at once (agent workers).")
    router: str = _f("request_num_balance", "How requests pick an instance: round_robin | request_num_balance.")
    sync_strategy: str = _f(
        "greedy", "When an instance pulls new weights: greedy (as soon as they exist) | request_num."
    )
    sync_request_threshold: int = _f(
        2, "request_num strategy: pull new weights once running requests on the instance drop below this."
    )
    runtime: str = _f(
        "local", "Where rollout models run: local (this process, worker threads) | ray (one Ray actor per instance)."
    )
    ray_address: Optional[str] = _f(None, "runtime=ray: address of an existing Ray cluster (null starts a local one).")
    reward_retries: int = _f(1, "Times a failing reward function / agent loop is retried before it is reported.")

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
        None, "Truncated importance sampling w = min(rho, C): null | token | sequence.", key="is"
    )
    is_threshold: float = _f(2.0, "C, the truncation of the IS weight.")
    rs: Optional[str] = _f(
        None, "Rejection sampling, mask data whose ratio is outside [lo, hi]: null | token | sequence | geometric."
    )
    rs_threshold: float = _f(2.0, "hi, the upper bound of the rejection-sampling ratio.")
    rs_threshold_lower: Optional[float] = _f(None, "lo, the lower bound (default 1 / rs_threshold).")


@dataclass
class FilterGroupsConfig:
    metric: Optional[str] = _f(
        None, "Metric the dynamic sampling filter reads: score | acc | seq_reward | seq_final_reward."
    )


@dataclass
class AlgorithmConfig:
    adv_estimator: str = _f("grpo", "Group advantage estimator: grpo.")
    norm_adv_by_std: bool = _f(True, "GRPO: divide the group-centred reward by the group std (False: Dr. GRPO style).")
    policy_loss: str = _f("ppo", "ppo (token-level ratio) | gspo (sequence-level ratio).")
    clip_ratio_low: float = _f(0.2, "PPO clip below: ratio >= 1 - clip_ratio_low.")
    clip_ratio_high: float = _f(0.28, "PPO clip above (DAPO clip-higher): ratio <= 1 + clip_ratio_high.")
    loss_agg_mode: str = _f("token-mean", "token-mean | seq-mean-token-mean | seq-mean-token-sum.")
    rollout_correction: RolloutCorrectionConfig = _sub(
        RolloutCorrectionConfig, "Off-policy corrections against the behaviour log-probs (needed for staleness >= 3)."
    )
    filter_groups: FilterGroupsConfig = _sub(FilterGroupsConfig, "Dynamic sampling filter settings.")


# --------------------------------------------------------------------------- model.*, task.*, trainer.*


@dataclass
class ModelConfig:
    path: Optional[str] = _f(None, "Local model directory (weights + tokenizer); null builds the tiny built-in model.")
    gguf_file: Optional[str] = _f(None, "GGUF file name inside model.path (needs the gguf package).")
    n_layer: int = _f(2, "Built-in model: transformer layers.")
    n_embd: int = _f(64, "Built-in model: hidden size.")
    n_head: int = _f(4, "Built-in model: attention heads.")
    n_positions: int = _f(128, "Built-in model: context length.")
    device: str = _f("auto", "auto | cpu | cuda.")
    dtype: str = _f("float32", "float32 | bfloat16 | float16.")


@dataclass
class TaskConfig:
    name: str = _f("tool_arith", "Built-in task name (arith, tool_arith), dataset (rows of data.train_files) or module:Class.")
    kwargs: dict = _f({}, "Extra keyword arguments for the task constructor.")
    reward: str = _f(
        "math", "Dataset tasks: math (math-verify) | exact | regex:<pattern> (group 1, else the match, equals the answer) | "
        "module:function or file.py:function (verl's compute_score(data_source, solution_str, ground_truth, extra_info), "
        "sync or async, returning a float or a dict with score and optional acc). Built-in tasks keep their own reward.")
    reward_timeout: float = _f(
        30.0, "Dataset tasks: seconds one reward call may take; a timeout counts as a failure (retried psrl.reward_retries times).")
    tool_latency_median: float = _f(0.05, "Agentic task: median tool latency in seconds (lognormal).")
    tool_latency_sigma: float = _f(1.0, "Agentic task: sigma of the lognormal tool latency (heavy tail).")
    max_turns: int = _f(3, "Agentic task: maximum model turns per trajectory.")


@dataclass
class TrainerConfig:
    total_steps: int = _f(40, "Training steps (consumed buffers) to run.")
    lr: float = _f(3e-4, "AdamW learning rate.")
    weight_decay: float = _f(0.0, "AdamW weight decay.")
    grad_clip: float = _f(1.0, "Max gradient norm.")
    minibatches: int = _f(1, "Optimiser steps per consumed batch (the batch is split in this many minibatches).")
    seed: int = _f(0, "Seed for torch, python and the task, so runs reproduce.")
    run_dir: Optional[str] = _f(None, "Where config.yaml, metrics.jsonl, trajectories.jsonl and weights go (default runs/<time>).")
    max_new_tokens: int = _f(8, "Tokens generated per model turn.")
    temperature: float = _f(1.0, "Sampling temperature.")
    top_p: float = _f(1.0, "Nucleus sampling threshold.")
    warm_start_steps: Optional[int] = _f(
        None, "Supervised warm-start steps on scripted demonstrations before RL (null = the task's default, 0 = none).")
    warm_start_lr: float = _f(2e-3, "AdamW learning rate of the supervised warm start (its own optimiser).")
    sync_tool_latency_scale: float = _f(
        0.0, "Synchronous loop only: multiply tool latencies by this (0 = no waiting, runs repeat exactly)."
    )
    resume: bool = _f(True, "Continue from the newest checkpoint in run_dir if there is one.")
    checkpoint_every: int = _f(10, "Save a resumable checkpoint every this many steps.")
    logger: list = _f(
        ["console"], "Where step metrics go besides metrics.jsonl (always written): any of console, tensorboard, wandb "
        "(wandb offline unless WANDB_MODE says otherwise). Override as trainer.logger=[console,tensorboard].")
    project_name: str = _f("psrl", "Project name the trackers file the run under.")
    experiment_name: Optional[str] = _f(None, "Run name in the trackers (default: the run directory's name).")
    val_every: int = _f(0, "Validate every this many steps and after the last one (0 = never).")
    val_n: int = _f(4, "Validation: samples per prompt for val/pass@k (k = val_n), besides the greedy answer.")
    val_size: int = _f(64, "Validation prompts of a built-in task (a fixed held-out draw); dataset tasks use data.val_files.")


@dataclass
class DataConfig:
    train_files: list = _f([], "task.name=dataset: training rows, one file or a list (.jsonl, .json, .parquet, .csv).")
    val_files: list = _f([], "Validation rows (same format); needed when trainer.val_every > 0 on a dataset task.")
    prompt_key: str = _f("prompt", "Column of the prompt: a string, or a list of chat messages ({role, content}).")
    answer_key: str = _f(
        "reward_model.ground_truth", "Dotted path to the reference answer in a row (verl's preprocessed files need no change).")
    max_prompt_length: int = _f(
        96, "Prompt tokens allowed (after the chat template, with <bos>); longer rows are an error unless filtered.")
    max_response_length: int = _f(32, "Tokens the model may generate per answer.")
    filter_overlong_prompts: bool = _f(False, "Drop (and count) prompts longer than max_prompt_length instead of failing.")
    shuffle: bool = _f(True, "Shuffle the training rows every epoch (by trainer.seed); the position is checkpointed.")


# --------------------------------------------------------------------------- sim.*


@dataclass
class GenTimeConfig:
    dist: str = _f("lognormal", "lognormal | pareto | constant | trace.")
    median: float = _f(1.0, "Median generation time of one trajectory (simulated seconds).")
    sigma: float = _f(1.0, "lognormal: sigma of log-time; pareto: shape alpha.")
    trace: Optional[str] = _f(None, "trace: a trajectories.jsonl whose timings are replayed.")


@dataclass
class SimConfig:
    slots: int = _f(64, "Generation slots (trajectories generated at once).")
    steps: int = _f(100, "Training steps to simulate.")
    gen_time: GenTimeConfig = _sub(GenTimeConfig, "Generation-time distribution of one trajectory.")
    train_time: float = _f(4.0, "Seconds per training step.")
    train_time_per_token: float = _f(0.0, "Extra seconds per batch token (train time as a function of batch tokens).")
    sync_time: float = _f(0.0, "Seconds a weight sync takes.")
    filter_drop_rate: float = _f(0.0, "Probability the group filter drops a completed group.")
    gen_tokens_per_second: float = _f(
        1.0, "Tokens a trajectory produces per simulated second of generation (batch tokens for train_time_per_token)."
    )
    trigger_parameter_sync_step: int = _f(
        1, "sample_budget policy (verl fully-async): trainer steps between parameter syncs."
    )
    seed: int = _f(0, "Seed of the workload's random stream (the same for every policy).")


# --------------------------------------------------------------------------- root


@dataclass
class Config:
    psrl: PsrlConfig = _sub(PsrlConfig, "Staleness control and rollout coordination.")
    algorithm: AlgorithmConfig = _sub(AlgorithmConfig, "Advantages, losses and corrections.")
    model: ModelConfig = _sub(ModelConfig, "The policy model.")
    task: TaskConfig = _sub(TaskConfig, "The task and its reward.")
    data: DataConfig = _sub(DataConfig, "Dataset files of task.name=dataset (verl's data.* keys).")
    trainer: TrainerConfig = _sub(TrainerConfig, "The training loop and run directory.")
    sim: SimConfig = _sub(SimConfig, "The workload of psrl simulate.")

    def validate(self) -> "Config":
        """Check cross-field rules; raise :class:`ConfigError` naming the key and the fix."""
        p, a = self.psrl, self.algorithm
        _check(p.staleness >= 0, "psrl.staleness", f"must be >= 0, got {p.staleness}", "use 0 for synchronous training")
        for key, value in [
            ("psrl.staleness_buffer_entries", p.staleness_buffer_entries),
            ("psrl.rollout_n", p.rollout_n),
            ("psrl.num_rollout_instances", p.num_rollout_instances),
            ("psrl.max_concurrent_per_instance", p.max_concurrent_per_instance),
        ]:
            _check(value >= 1, key, f"must be >= 1, got {value}")
        rr = p.redundant_rollout
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
        del rr
        _one_of("psrl.router", p.router, ["round_robin", "request_num_balance"])
        _one_of("psrl.sync_strategy", p.sync_strategy, ["greedy", "request_num"])
        _one_of("psrl.runtime", p.runtime, ["local", "ray"])
        _one_of("psrl.proactive_filter_strategy.method", p.proactive_filter_strategy.method, [None, "retry", "truncate"])
        _check(p.proactive_filter_strategy.threshold >= 1, "psrl.proactive_filter_strategy.threshold", "must be >= 1")
        gpp = p.group_post_process
        if gpp.enable:
            _check(gpp.name is not None, "psrl.group_post_process.name", "is null but group_post_process.enable is true",
                   "set name: dynamic_sampling_filter (or module:callable), or enable: false")
            if gpp.name is not None and ":" not in gpp.name:
                _one_of("psrl.group_post_process.name", gpp.name, ["dynamic_sampling_filter"])
            if gpp.name == "dynamic_sampling_filter":
                _check(
                    a.filter_groups.metric is not None,
                    "algorithm.filter_groups.metric",
                    "dynamic_sampling_filter needs a metric",
                    "set algorithm.filter_groups.metric to score, acc, seq_reward or seq_final_reward",
                )
        _one_of("algorithm.filter_groups.metric", a.filter_groups.metric, [None, "score", "acc", "seq_reward", "seq_final_reward"])
        _one_of("algorithm.adv_estimator", a.adv_estimator, ["grpo"])
        _one_of("algorithm.policy_loss", a.policy_loss, ["ppo", "gspo"])
        _one_of("algorithm.loss_agg_mode", a.loss_agg_mode, ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
        rc = a.rollout_correction
        _one_of("algorithm.rollout_correction.is", rc.is_, [None, "token", "sequence"])
        _one_of("algorithm.rollout_correction.rs", rc.rs, [None, "token", "sequence", "geometric"])
        _check(rc.is_threshold > 0, "algorithm.rollout_correction.is_threshold", "must be > 0")
        _check(rc.rs_threshold > 0, "algorithm.rollout_correction.rs_threshold", "must be > 0")
        _check(a.clip_ratio_low >= 0 and a.clip_ratio_high >= 0, "algorithm.clip_ratio_low", "clip ratios must be >= 0")
        _one_of("model.device", self.model.device, ["auto", "cpu", "cuda"])
        _one_of("model.dtype", self.model.dtype, ["float32", "bfloat16", "float16"])
        _check(self.trainer.total_steps >= 1, "trainer.total_steps", "must be >= 1")
        _check(self.trainer.minibatches >= 1, "trainer.minibatches", "must be >= 1")
        ws = self.trainer.warm_start_steps
        _check(ws is None or ws >= 0, "trainer.warm_start_steps",
               f"must be >= 0 or null, got {ws}", "use 0 to skip the warm start, null for the task's default")
        self._validate_data_and_logging()
        _check(self.sim.slots >= 1, "sim.slots", "must be >= 1")
        _one_of("sim.gen_time.dist", self.sim.gen_time.dist, ["lognormal", "pareto", "constant", "trace"])
        if self.sim.gen_time.dist == "trace":
            _check(self.sim.gen_time.trace is not None, "sim.gen_time.trace", "dist is trace but no file is given",
                   "set sim.gen_time.trace=path/to/trajectories.jsonl")
        return self


    def _validate_data_and_logging(self) -> None:
        t, d = self.trainer, self.data
        for name in t.logger:
            _one_of("trainer.logger", name, ["console", "tensorboard", "wandb"])
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


def _one_of(key: str, value: Any, allowed: list) -> None:
    if value not in allowed:
        names = [("null" if x is None else str(x)) for x in allowed]
        close = difflib.get_close_matches(str(value), [n for n in names], n=1)
        fix = f"use one of {', '.join(names)}" + (f" (did you mean '{close[0]}'?)" if close else "")
        raise ConfigError(key, f"unknown value {value!r}", fix)


# --------------------------------------------------------------------------- loading


def _yaml_key(f: dataclasses.Field) -> str:
    return f.metadata.get("key", f.name)


def _hints(cls: type) -> dict:
    return typing.get_type_hints(cls, globalns=sys.modules[__name__].__dict__)


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check/convert one YAML value against its annotated type."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [t for t in typing.get_args(tp) if t is not type(None)]
        if value is None:
            return None
        return _coerce(value, args[0], key)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(key, f"expected a mapping, got {value!r}", f"write it as '{key}: {{...}}'")
        return _build(tp, value, key)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(key, f"expected true/false, got {value!r}")
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise ConfigError(key, f"expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads 2e-3 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(key, f"expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(key, f"expected a string, got {value!r}")
        return value
    if tp is dict or origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(key, f"expected a mapping, got {value!r}")
        return dict(value)
    if tp is list or origin is list:
        if isinstance(value, str):  # one file / one logger: "a" means ["a"]
            return [value]
        if not isinstance(value, list):
            raise ConfigError(key, f"expected a list, got {value!r}")
        return list(value)
    return value


def _build(cls: type, data: dict, prefix: str = "") -> Any:
    hints = _hints(cls)
    by_key = {_yaml_key(f): f for f in dataclasses.fields(cls)}
    kwargs = {}
    for k, v in data.items():
        full = f"{prefix}.{k}" if prefix else str(k)
        if k not in by_key:
            close = difflib.get_close_matches(str(k), list(by_key), n=1)
            fix = f"did you mean '{(prefix + '.') if prefix else ''}{close[0]}'?" if close else (
                f"known keys here: {', '.join(sorted(by_key))}")
            raise ConfigError(full, "unknown key", fix)
        f = by_key[k]
        kwargs[f.name] = _coerce(v, hints[f.name], full)
    return cls(**kwargs)


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


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Load YAML (or the built-in defaults when ``path`` is None), apply overrides, validate."""
    import yaml

    data: dict = {}
    if path is not None:
        p = Path(path)
        if not p.exists():
            raise ConfigError(str(path), "config file not found", "give an existing YAML file, or no file for the defaults")
        loaded = yaml.safe_load(p.read_text()) or {}
        if not isinstance(loaded, dict):
            raise ConfigError(str(path), "top level of the YAML file must be a mapping")
        data = loaded
    apply_overrides(data, list(overrides or []))
    return _build(Config, data).validate()


# --------------------------------------------------------------------------- reference doc


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [t for t in typing.get_args(tp) if t is not type(None)]
        return _type_name(args[0]) + " | null"
    return getattr(tp, "__name__", str(tp))


def _rows(cls: type, prefix: str) -> list[tuple[str, str, str, str]]:
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
        rows.append((key, _type_name(tp), shown, f.metadata.get("help", "")))
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
        lines += [f"## `{sect}` -- {f.metadata['help']}", "", "| key | type | default | meaning |", "|---|---|---|---|"]
        for key, tp, default, help in _rows(_hints(Config)[f.name], sect):
            cells = [f"`{key}`", tp, f"`{default}`", help]
            lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")  # '|' would split a cell
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":  # pragma: no cover
    print(reference_markdown())
