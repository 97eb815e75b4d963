"""``rollout.engine: hf``: continuous batching in this process with a KV cache (transformers).

Each decode step feeds one new token per running request and reuses the keys/values of
everything before it, so a sequence of L tokens costs O(L) instead of the O(L^2) of the no-cache
twin (:class:`psrl.rollout.engines.base.NoCacheEngine`). Requests join and leave at any token
boundary: a joining request is prefilled on its own (its whole context, left-padded among the
other joiners) and its cache rows are merged into the batch's; a leaving request's rows are
dropped. The batch cache is left-padded: an attention mask marks the real positions and each
row's position ids count only its real tokens, so every row sees exactly what it would alone
and its log-probs match the trainer's recomputation (:meth:`psrl.models.Policy.sequence_logprobs`)
to float tolerance.

Invariant: the cache of a running row holds ``context + tokens[:-1]``; its last sampled token
is the next step's input.

A request with a ``seed`` draws its ``i``-th token with ``stream_uniform(seed, i)`` (inverse-CDF, row by row:
:func:`psrl.models.policy.sample`), so its tokens do not depend on the rows it shares a step with; an unseeded
request draws from the policy's one generator, in batch order.

Across a weight update under partial rollout (``rollout.kv_after_update``):

* ``recompute`` (default): the cache is dropped and every kept request is prefilled again under
  the new weights at its next step. Tokens after the update are exactly what the new policy
  produces given the prefix; the cost is one prefill per in-flight request per update.
* ``keep``: the cache survives the update (vLLM's ``clear_cache=False``, the "stale KV" of
  PSRL's partial rollout). New tokens attend to keys/values the old weights computed, so their
  behaviour log-probs are not exactly what the trainer recomputes for the new version; the
  off-policy corrections see that difference, and ``engine/logprob_mismatch_*`` shows it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from pathlib import Path

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicLayer

from psrl.models.policy import Policy, left_pad, sample
from psrl.rollout.engines.base import BatchingEngine, row_uniforms
from psrl.types import GenRequest, Sampling, WeightState
from psrl.weights import StreamedVersions, check_version, read_buckets, read_manifest, tied_names, with_tied
from psrl.weights.adapter import MergedAdapter, is_adapter

__all__ = ["HFEngine", "KV_MODES"]

KV_MODES = ("recompute", "keep")


class HFEngine(BatchingEngine):
    """A :class:`BatchingEngine` over a :class:`psrl.models.Policy` with a batch KV cache.

    Args:
        policy: the rollout copy of the policy (model, sampling generator, version).
        kv_after_update: ``recompute`` | ``keep`` (module docstring).
        sampling, max_batch: as :class:`BatchingEngine`.
    """

    def __init__(
        self,
        policy: Policy,
        kv_after_update: str = "recompute",
        *,
        sampling: Sampling = Sampling(),
        max_batch: int | None = None,
    ):
        super().__init__(sampling=sampling, max_batch=max_batch)
        if kv_after_update not in KV_MODES:
            raise ValueError(f"kv_after_update must be one of {KV_MODES}, got {kv_after_update!r}")
        self.policy = policy
        self.kv_after_update = kv_after_update
        self.prefills = 0
        """Requests prefilled (joins, and re-prefills after a ``recompute`` update)."""
        self._cached: list[GenRequest] = []
        self._cache: Cache | None = None
        self._mask: torch.Tensor | None = None
        self._adapter: MergedAdapter | None = None
        """LoRA versions (:mod:`psrl.weights.adapter`): merged into the model over a kept copy of its base."""

    @property
    def version(self) -> int:
        return int(self.policy.version)

    @property
    def model(self) -> Policy:
        return self.policy

    async def _decode(self, rows: list[GenRequest]) -> tuple[list[int], list[float]]:
        return await asyncio.to_thread(self.step, rows)

    async def _load(self, state: WeightState, version: int) -> None:
        if any(is_adapter(n) for n in state):
            await asyncio.to_thread(self._lora().load, state)
            self.policy.version = int(version)
        else:
            self._adapter = None  # a whole model: any kept base is stale
            await asyncio.to_thread(self.policy.load_weights, state, version)
        if self.kv_after_update == "recompute":
            self._drop_all()

    async def _load_directory(self, directory: Path, version: int) -> None:
        """A published directory, bucket by bucket: every bucket checked first (a damaged version leaves the old
        weights), then each loaded into the model as it is read, so at most one bucket is held beside the model. A
        tied tensor comes once (the manifest's ``tied``): loading its canonical name loads the model's alias."""
        await asyncio.to_thread(self._stream, directory, version)
        if self.kv_after_update == "recompute":
            self._drop_all()

    async def _load_streamed(self, store: StreamedVersions, version: int) -> None:
        """A version held bucket by bucket (received over the collective transport, checked on arrival): each
        bucket loaded into the model as it is read, so at most one is held beside the model."""
        names, tied, buckets = store.names(version), store.tied(version), store.buckets(version)
        await asyncio.to_thread(self._into_model, names, tied, buckets, version, store.name)
        if self.kv_after_update == "recompute":
            self._drop_all()

    def _stream(self, directory: Path, version: int) -> None:
        manifest = read_manifest(directory)
        names = [n for b in manifest["buckets"] for n in b["names"]]
        if manifest.get("kind") == "lora":
            self._lora().check(set(names))
        got = check_version(directory)
        if got != version:
            raise ValueError(f"{directory} holds version {got}, not {version}")
        buckets = (tensors for _, tensors in read_buckets(directory, check=False))
        if manifest.get("kind") == "lora":
            self._lora().load_buckets(buckets, set(names))
            self.policy.version = int(version)
        else:
            self._into_model(names, manifest.get("tied", {}), buckets, version, str(directory))

    def _into_model(
        self, names: Iterable[str], tied: dict[str, str], buckets: Iterable[WeightState], version: int, where: str
    ) -> None:
        """Copy a whole model's ``buckets`` into the engine's model (``names``: every tensor they hold, checked
        against the model's first: a version of another model changes nothing). A tied tensor comes once
        (``tied``: ``{alias: canonical}``): loading its canonical name loads the model's alias."""
        model = self.policy.model
        state = model.state_dict()
        have, names = set(state), set(names)
        if names | set(tied) != have:
            raise ValueError(
                f"{where}: its tensors are not the engine's model's (missing {sorted(have - names - set(tied))[:3]}, "
                f"unknown {sorted(names - have)[:3]})"
            )
        self._adapter = None
        own = tied_names(state)  # loading the canonical name loads these aliases too
        untied = {a: c for a, c in tied.items() if own.get(a) != c}  # the version's ties this model lacks
        for tensors in buckets:
            more = {a: c for a, c in untied.items() if c in tensors}
            model.load_state_dict(with_tied(dict(tensors), more), strict=False)
        self.policy.version = int(version)

    def _lora(self) -> MergedAdapter:
        if self._adapter is None:
            self._adapter = MergedAdapter(self.policy.model)
        return self._adapter

    async def restart(self) -> None:
        """Start over after a failure: no cache, the same weights (the instance reloads the newest)."""
        self._drop_all()

    # ------------------------------------------------------------------ one step (worker thread)

    @torch.no_grad()
    def step(self, rows: list[GenRequest]) -> tuple[list[int], list[float]]:
        """Next token of every row: decode the cached rows, prefill the new ones, sample all together."""
        self._keep_only(rows)
        known = {id(r) for r in self._cached}
        joins = [r for r in rows if id(r) not in known]
        logits = []
        if self._cached:
            logits.append(self._decode_cached())
        if joins:
            logits.append(self._prefill(joins))
        sp = self.sampling  # logits are in _cached order (the joins were appended to it): so are the numbers
        toks, lps = sample(
            torch.cat(logits, dim=0), sp.temperature, sp.top_p, self.policy.generator, row_uniforms(self._cached)
        )
        where = {id(r): i for i, r in enumerate(self._cached)}
        order = [where[id(r)] for r in rows]
        return [toks[i] for i in order], [lps[i] for i in order]

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, cache: Cache) -> torch.Tensor:
        out = self.policy.model(
            input_ids=ids, attention_mask=mask, position_ids=pos, cache=cache, use_cache=True, logits_to_keep=1
        )
        self._last_cache = cache  # extended in place
        return out.logits[:, -1, :]

    def _batch(self) -> tuple[Cache, torch.Tensor]:
        """The batch cache and its mask: both exist exactly while a row is cached (set and dropped together)."""
        assert self._cache is not None and self._mask is not None, "no cached rows"
        return self._cache, self._mask

    def _decode_cached(self) -> torch.Tensor:
        """One token for every cached row: its last sampled token in, the cache extended by one."""
        dev = self.policy.device
        cache, old = self._batch()
        ids = torch.tensor([[r.tokens[-1]] for r in self._cached], dtype=torch.long, device=dev)
        pos = old.sum(dim=1, keepdim=True)
        mask = torch.cat([old, torch.ones_like(pos)], dim=1)
        logits = self._forward(ids, mask, pos, cache)  # keys/values appended in place
        self._mask = mask
        return logits

    def _prefill(self, joins: list[GenRequest]) -> torch.Tensor:
        """Prefill ``context + tokens`` of each joining row and merge its cache into the batch's."""
        self.prefills += len(joins)
        ids, mask = left_pad([r.context + r.tokens for r in joins], self.policy.pad_id, self.policy.device)
        pos = (mask.cumsum(dim=1) - 1).clamp(min=0)
        logits = self._forward(ids, mask, pos, DynamicCache())
        kv = _layers(self._last_cache)
        if self._cache is None:
            self._cache, self._mask = _grow_cache(kv), mask
        else:
            cache, old = self._batch()
            width = max(old.shape[1], mask.shape[1])
            _set(
                cache,
                [
                    (torch.cat([_lpad(k0, width), _lpad(k1, width)]), torch.cat([_lpad(v0, width), _lpad(v1, width)]))
                    for (k0, v0), (k1, v1) in zip(_layers(cache), kv)
                ],
            )
            self._mask = torch.cat([_lpad(old, width), _lpad(mask, width)])
        self._cached = self._cached + list(joins)
        return logits

    def _keep_only(self, rows: list[GenRequest]) -> None:
        """Drop the cache rows of requests that left; trim columns no remaining row uses."""
        live = {id(r) for r in rows}
        keep = [i for i, r in enumerate(self._cached) if id(r) in live]
        if len(keep) == len(self._cached):
            return
        if not keep:
            self._drop_all()
            return
        cache, old = self._batch()
        idx = torch.tensor(keep, dtype=torch.long, device=old.device)
        mask = old.index_select(0, idx)
        used = mask.sum(dim=0).nonzero()
        first = int(used[0]) if len(used) else mask.shape[1]
        self._mask = mask[:, first:]
        _set(
            cache,
            [(k.index_select(0, idx)[:, :, first:], v.index_select(0, idx)[:, :, first:]) for k, v in _layers(cache)],
        )
        self._cached = [self._cached[i] for i in keep]

    def _drop_all(self) -> None:
        self._cached, self._cache, self._mask = [], None, None


def _layers(cache: Cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Keys and values of every layer of a filled attention cache (what a forward pass of a Policy leaves)."""
    out: list[tuple[torch.Tensor, torch.Tensor]] = []
    for layer in cache.layers:
        if not isinstance(layer, CacheLayerMixin) or layer.keys is None or layer.values is None:
            raise TypeError(f"HFEngine needs filled attention cache layers, got {type(layer).__name__}")
        out.append((layer.keys, layer.values))
    return out


class _GrowLayer(DynamicLayer):
    """A cache layer with spare room: a decode step writes its keys/values in place instead of ``torch.cat``
    (which copies the whole cache every step, O(L) per token); the room doubles when it runs out."""

    def set(self, keys: torch.Tensor, values: torch.Tensor, room: int = 64) -> None:
        b, h, n, d = keys.shape
        self._k = keys.new_empty((b, h, n + room, d))
        self._v = values.new_empty((b, values.shape[1], n + room, values.shape[-1]))
        self._k[:, :, :n] = keys
        self._v[:, :, :n] = values
        self.n, self.device, self.is_initialized = n, keys.device, True
        self.keys, self.values = self._k[:, :, :n], self._v[:, :, :n]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        t = key_states.shape[-2]
        if self.n + t > self._k.shape[-2]:
            # the filled part, which is what self.keys / self.values hold
            self.set(self._k[:, :, : self.n], self._v[:, :, : self.n], room=max(self.n, 64) + t)
        self._k[:, :, self.n : self.n + t] = key_states
        self._v[:, :, self.n : self.n + t] = value_states
        self.n += t
        self.keys, self.values = self._k[:, :, : self.n], self._v[:, :, : self.n]
        return self.keys, self.values


def _grow_cache(kv: list[tuple[torch.Tensor, torch.Tensor]]) -> Cache:
    cache = Cache(layers=[_GrowLayer() for _ in kv])
    _set(cache, kv)
    return cache


def _set(cache: Cache, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    for layer, (k, v) in zip(cache.layers, kv):
        if not isinstance(layer, _GrowLayer):  # every layer of a batch cache is (made by _grow_cache)
            raise TypeError(f"expected a _GrowLayer of the batch cache, got {type(layer).__name__}")
        layer.set(k, v)


def _lpad(t: torch.Tensor, width: int) -> torch.Tensor:
    """Left-pad the sequence dimension (last for a mask, -2 for keys/values) with zeros up to ``width``."""
    dim = -1 if t.dim() == 2 else -2
    missing = width - t.shape[dim]
    if missing <= 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t.new_zeros(shape), t], dim=dim)
