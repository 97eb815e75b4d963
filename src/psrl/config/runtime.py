"""The ``runtime.*`` and ``weights.*`` sections: where the rollout engines and the trainer's ranks run, and how a
version's weights travel from the ranks to the engines."""

from __future__ import annotations

import re
from dataclasses import dataclass

from psrl.config.fields import _f
from psrl.config.rules import require

# --------------------------------------------------------------------------- runtime.*

_LABEL_KEY = re.compile(r"([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?")
"""A Ray node label key (Kubernetes' syntax: an optional DNS prefix and ``/``, then up to 63 characters)."""


@dataclass(frozen=True)
class RuntimeConfig:
    backend: str = _f(
        "local",
        "Where rollout engines and trainer ranks run: local (engines in this process; trainer ranks, when "
        "psrl.deployment.train_nnodes x train_ngpus_per_node > 1, as processes of this machine) | ray (one Ray "
        "actor per engine instance, one per trainer rank in a placement group: a GPU per rank with "
        "model.device=cuda, a CPU otherwise; train_nnodes > 1 allowed).",
        choices=("local", "ray"),
    )
    ray_address: str | None = _f(
        None,
        "backend=ray: address of an existing Ray cluster (null starts a local one).",
        note="address of a running Ray cluster (host:port); only with runtime.backend=ray",
    )
    ray_pool_label: str | None = _f(
        None,
        "backend=ray: the Ray node label that splits the cluster into pools (null: no pools, actors go where they "
        "fit): the trainer's ranks are placed on nodes labelled <label>=trainer, the rollout instances on nodes "
        "labelled <label>=rollout, one instance per rollout node in turn (ray start --labels=psrl-pool=trainer; "
        "docs/scaling.md).",
        note="a Ray node label key, e.g. psrl-pool; only with runtime.backend=ray",
    )

    ray_rejoin_every_s: float = _f(
        10.0,
        "backend=ray with runtime.ray_pool_label: how often a rollout instance given up on (its engine actor gone "
        "with its node, or failed) looks for a rollout node with room -- its node back, or another -- to rejoin on "
        "with a new engine actor (docs/scaling.md).",
        gt=0,
    )
    ray_rejoin_attempts: int = _f(
        3,
        "backend=ray with runtime.ray_pool_label: the most new engine actors a rollout instance given up on gets "
        "over the run, each started where runtime.ray_rejoin_every_s finds room (0: it never rejoins).",
        ge=0,
    )

    def check(self) -> None:
        require(
            self.ray_address is None or self.backend == "ray",
            "runtime.ray_address",
            f"is set but runtime.backend is {self.backend!r}, so nothing would read it",
            "set runtime.backend=ray, or remove runtime.ray_address",
        )
        require(
            self.ray_pool_label is None or self.backend == "ray",
            "runtime.ray_pool_label",
            f"is set but runtime.backend is {self.backend!r}, so nothing would read it",
            "set runtime.backend=ray, or remove runtime.ray_pool_label",
        )
        require(
            self.ray_pool_label is None or _LABEL_KEY.fullmatch(self.ray_pool_label) is not None,
            "runtime.ray_pool_label",
            f"is {self.ray_pool_label!r}, not a Ray node label key",
            "use letters, digits, '-', '_' and '.', starting and ending with a letter or digit (e.g. psrl-pool)",
        )


# --------------------------------------------------------------------------- weights.*


TRANSPORTS = ("files", "collective")
"""``weights.transport``: how a version travels from the trainer's ranks to the engines."""


@dataclass(frozen=True)
class WeightsConfig:
    bucket_mb: float = _f(
        256,
        "Publishing a version (psrl.weights): the most MB of parameters a trainer rank gathers and casts at once -- "
        "one bucket, one file of the version's directory. Smaller: less memory above the rank's shard while it "
        "publishes; larger: fewer files and collectives.",
        gt=0,
    )
    transport: str = _f(
        "files",
        "How a published version reaches the engines: files (the ranks write RUN_DIR/weights/v{N} bucket by bucket; "
        "every engine reads it; works everywhere) | collective (the ranks send the buckets over a process group "
        "the engines' side joins -- gloo, CPU buffers -- no shared filesystem; hf engines, or vLLM servers psrl "
        "starts; the first version goes as files). Every transport checks the version's digest before an engine "
        "serves it.",
        choices=TRANSPORTS,
    )

    def check(self, engine: str, backend: str, attached: bool) -> None:
        """``collective`` needs engines that can join the transfer group: ``hf`` engines in this process, or vLLM
        servers psrl starts (with its receiver; ``attached``: servers of ``rollout.vllm.urls`` have none)."""
        joins = backend == "local" and (engine == "hf" or (engine == "vllm" and not attached))
        require(
            self.transport != "collective" or joins,
            "weights.transport",
            f"is collective, but rollout.engine={engine} with runtime.backend={backend}"
            + (" and rollout.vllm.urls" if attached else "")
            + " cannot join the transfer group (hf engines in this process and vLLM servers psrl starts can)",
            "set weights.transport=files, or runtime.backend=local with rollout.engine=hf or psrl's own vLLM servers",
        )
