"""``psrl.deployment`` (the resource shape: rollout instances, trainer ranks) and ``psrl.checkpoint``.

PSRL's keys with PSRL's meanings; a key that does nothing on this project's machines says so in ``effect=``.
"""

from __future__ import annotations

from dataclasses import dataclass

from psrl.config.fields import _f
from psrl.config.rules import require

_NO_SHAPE = "psrl runs every rollout instance as one engine on this machine: the engine's own settings size it"


@dataclass(frozen=True)
class DeploymentConfig:
    n_rollout_instances: int = _f(
        1,
        "Rollout instances, each with its own engine, weights and version.",
        ge=1,
        fix="set psrl.deployment.n_rollout_instances=1 or more",
    )
    rollout_nnodes_per_instance: int = _f(1, "Nodes per rollout instance.", ge=1, effect=_NO_SHAPE)
    rollout_ngpus_per_node_per_instance: int = _f(
        1,
        "GPUs per node of each rollout instance.",
        ge=1,
        effect=_NO_SHAPE + " (rollout.vllm.args for tensor parallel)",
    )
    train_nnodes: int = _f(
        1,
        "Nodes of the trainer; its world size is train_nnodes x train_ngpus_per_node. The local launcher "
        "(runtime.backend=local) runs on one node: only 1; runtime.backend=ray places the ranks on the Ray "
        "cluster's nodes.",
        ge=1,
    )
    train_ngpus_per_node: int = _f(
        1,
        "Trainer ranks per node: GPUs with model.device=cuda, processes with cpu (FSDP2 over gloo). 1 = one "
        "rank in the driver's own process (no process group); more = that many rank processes (Ray actors with "
        "runtime.backend=ray), sharded (docs/trainer.md).",
        ge=1,
    )
    n_validate_instances: int = _f(
        1,
        "Validation instances: engines of their own (trainer.val_every), apart from the rollout's, each loading "
        "the newest published version before a validation; its episodes are spread over them. rollout.engine=vllm: "
        "vLLM servers psrl starts (val/* is then vLLM's sampling, not comparable with figures measured in "
        "process); hf: engines in the driver's process (the first over the trained policy itself at one rank, "
        "copies of it otherwise).",
        ge=1,
        fix="set psrl.deployment.n_validate_instances=1 or more",
    )

    @property
    def train_world_size(self) -> int:
        """Trainer ranks: ``train_nnodes x train_ngpus_per_node``."""
        return self.train_nnodes * self.train_ngpus_per_node

    def check(self, device: str, cpus: int | None, backend: str = "local") -> None:
        """The trainer's shape on this machine (``device``: model.device; ``cpus``: this machine's cores;
        ``backend``: runtime.backend, whose launcher starts the ranks: ray may use several nodes)."""
        require(
            self.train_nnodes == 1 or backend == "ray",
            "psrl.deployment.train_nnodes",
            f"is {self.train_nnodes}, but the local trainer launcher starts its ranks on this machine only",
            "set psrl.deployment.train_nnodes=1 (and train_ngpus_per_node to the ranks of this machine), "
            "or runtime.backend=ray to place the ranks on a Ray cluster's nodes",
        )
        n = self.train_ngpus_per_node
        require(
            device == "cuda" or n == 1 or cpus is None or n <= cpus,
            "psrl.deployment.train_ngpus_per_node",
            f"is {n} CPU ranks, more than this machine's {cpus} cores",
            f"set psrl.deployment.train_ngpus_per_node={cpus} or less (or model.device=cuda on a GPU machine)",
        )


@dataclass(frozen=True)
class CheckpointConfig:
    use_dcp_save: bool = _f(
        False,
        "PSRL's switch to save the trainer with torch.distributed.checkpoint (DCP; PSRL: Megatron).",
        effect="the trainer always writes model and AdamW as DCP (checkpoint/ranks/), at every world size; a "
        "checkpoint resumes at any world size (docs/trainer.md)",
    )
