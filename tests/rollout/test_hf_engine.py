"""The KV-cached engine against its slow twin, across weight updates, and the mismatch metric it feeds.

* fast vs reference: greedy generation with requests joining and leaving at random token
  boundaries gives the same tokens as the no-cache engine, log-probs equal to float tolerance;
* ``rollout.kv_after_update``: ``recompute`` makes post-update log-probs exactly the new policy's,
  ``keep`` (stale KV) does not -- the difference the mismatch metric is there to show;
* an engine that skips a weight update makes ``engine/logprob_mismatch_max`` jump.
"""

import asyncio
import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from psrl.rollout.engines.base import NoCacheEngine
from psrl.rollout.engines.hf import HFEngine
from psrl.train.steps import logprob_mismatch
from psrl.types import GenRequest, Sampling
from psrl.weights import ParameterStore


async def _staggered(engine, specs):
    """Start request i after ``delay_i`` loop turns; returns the requests once all finished."""
    await engine.start()
    reqs = [GenRequest(ctx, n) for ctx, n, _ in specs]

    async def go(req, delay):
        for _ in range(delay):
            await asyncio.sleep(0)
        await engine.generate(req)

    await asyncio.gather(*(go(r, d) for r, (_, _, d) in zip(reqs, specs)))
    await engine.close()
    return reqs


@settings(max_examples=8, deadline=None)
@given(st.randoms(use_true_random=False))
def test_cached_engine_equals_the_no_cache_twin_with_joins_and_leaves(tiny, rnd):
    """Random contexts, budgets and join times: identical greedy tokens, log-probs within 1e-5."""
    _, _, policy = tiny
    vocab = policy.model.config.vocab_size
    specs = [
        ([rnd.randrange(3, vocab) for _ in range(rnd.randrange(1, 12))], rnd.randrange(1, 16), rnd.randrange(0, 30))
        for _ in range(rnd.randrange(1, 6))
    ]
    fast = asyncio.run(_staggered(HFEngine(policy.replica(1), sampling=Sampling(temperature=0)), specs))
    slow = asyncio.run(_staggered(NoCacheEngine(policy.replica(1), sampling=Sampling(temperature=0)), specs))
    for f, s in zip(fast, slow):
        assert f.tokens == s.tokens
        assert max(abs(a - b) for a, b in zip(f.logprobs, s.logprobs)) < 1e-5


def _perturbed_state(policy, seed, scale=0.3):
    gen = torch.Generator().manual_seed(seed)
    return {
        k: v + torch.randn(v.shape, generator=gen) * scale if v.is_floating_point() else v
        for k, v in policy.export_state().items()
    }


async def _update_mid_request(engine, store, n_before=4, total=20):
    """Generate; after ``n_before`` tokens pause, load v2, resume; return the finished request."""
    await engine.start()
    req = GenRequest([1, 5, 6, 7], total)
    task = asyncio.ensure_future(engine.generate(req))
    while len(req.tokens) < n_before:
        await asyncio.sleep(0)
    await engine.pause()
    await engine.update_weights(2, store)
    await engine.resume()
    await task
    await engine.close()
    return req


@pytest.mark.parametrize("mode", ["recompute", "keep"])
def test_kv_after_update_recompute_is_exact_and_keep_is_stale(tiny, mode):
    """After a mid-request update, ``recompute`` log-probs equal the new policy's recomputation for
    every token after the update (<1e-4); ``keep`` attends to keys/values of the old weights, so they differ."""
    _, _, policy = tiny
    store = ParameterStore(keep=4)
    store.publish(1, policy.export_state())
    new = copy.deepcopy(policy)
    new.load_weights(_perturbed_state(policy, seed=7), 2)
    store.publish(2, new.export_state())
    engine = HFEngine(policy.replica(4), kv_after_update=mode)
    engine.policy.version = 1
    req = asyncio.run(_update_mid_request(engine, store))
    after = [i for i, v in enumerate(req.versions) if v == 2]
    assert after and req.versions[: after[0]] == [1] * after[0]
    with torch.no_grad():
        recomputed = new.sequence_logprobs([req.context], [req.tokens])[0].tolist()
    diff = max(abs(recomputed[i] - req.logprobs[i]) for i in after)
    if mode == "recompute":
        assert diff < 1e-4 and engine.prefills == 2  # the join, then once more after the update
    else:
        assert diff > 1e-3 and engine.prefills == 1


class _SkipsUpdates(HFEngine):
    """A broken engine: takes the new version number but keeps the old weights."""

    async def _load(self, state, version):
        self.policy.version = version


@pytest.mark.parametrize("engine_cls,jumps", [(HFEngine, False), (_SkipsUpdates, True)])
def test_mismatch_metric_jumps_when_an_engine_skips_a_weight_update(tiny, engine_cls, jumps):
    """Tokens labelled v2 but produced by v1's weights: engine/logprob_mismatch_max jumps above 1e-2;
    with the update applied it stays below 1e-4 (float tolerance)."""
    _, _, policy = tiny
    store = ParameterStore(keep=4)
    new = copy.deepcopy(policy)
    new.load_weights(_perturbed_state(policy, seed=11), 2)
    store.publish(2, new.export_state())
    engine = engine_cls(policy.replica(5))

    async def main():
        await engine.start()
        await engine.update_weights(2, store)
        reqs = [GenRequest([1, 5, 6 + i], 12) for i in range(4)]
        await asyncio.gather(*(engine.generate(r) for r in reqs))
        await engine.close()
        return reqs

    reqs = asyncio.run(main())

    def pad(rows):
        return torch.nn.utils.rnn.pad_sequence([torch.tensor(r, dtype=torch.float32) for r in rows], batch_first=True)

    with torch.no_grad():
        recomputed = new.sequence_logprobs([r.context for r in reqs], [r.tokens for r in reqs])
    m = logprob_mismatch(
        recomputed,
        pad([r.logprobs for r in reqs]),
        pad([[1] * len(r.tokens) for r in reqs]),
        pad([r.versions for r in reqs]),
        2,
    )
    assert m["engine/mismatch_tokens"] == 48
    assert (m["engine/logprob_mismatch_max"] > 1e-2) if jumps else (m["engine/logprob_mismatch_max"] < 1e-4)
