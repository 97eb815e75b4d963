"""Reproducible sampling (issue 34): a request with a seed samples from its own stream, whatever it is batched with.

* engine level: a seeded request samples the same tokens alone and inside a batch of 16 (the others joining and
  leaving at random token boundaries), on ``hf`` and on the no-cache twin; another seed samples other tokens;
* the draw itself: inverse-CDF sampling against a slow reference, never a zero-probability token, and the
  token frequencies of many seeds follow the distribution;
* the names of the streams: a session derives each request's seed from the trajectory's seed, the turn and the
  tokens the turn already has, so a request continued after an interruption gets the stream of that point.
"""

import asyncio
import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from psrl.models.policy import inverse_cdf, sample
from psrl.rollout.engines.base import NoCacheEngine
from psrl.rollout.engines.hf import HFEngine
from psrl.rollout.fakes import FakeEngine
from psrl.rollout.serving.session import Session
from psrl.runtime.vloop import run_virtual
from psrl.types import GenRequest, Sampling, stream_seed, stream_uniform
from psrl.weights import ParameterStore
from tests.rollout.harness import pool_of

ENGINES = {"hf": HFEngine, "nocache": NoCacheEngine}


async def _batched(engine, reqs, delays):
    """Every request through ``engine``, request i joining after ``delays[i]`` loop turns."""
    await engine.start()

    async def one(req, delay):
        for _ in range(delay):
            await asyncio.sleep(0)
        await engine.generate(req)

    await asyncio.gather(*(one(r, d) for r, d in zip(reqs, delays)))
    await engine.close()
    return reqs


@pytest.mark.parametrize("top_p", [1.0, 0.9])
@pytest.mark.parametrize("kind", sorted(ENGINES))
def test_a_seeded_request_samples_the_same_tokens_alone_and_in_a_batch_of_16(tiny, kind, top_p):
    """The same request (context, budget, seed) alone, then as one of 16 requests of other lengths, budgets and
    seeds that join at random token boundaries, on engines whose shared generators are seeded differently: the
    same tokens. Temperature 1, so every token is a real draw; a second seed gives other tokens."""
    _, _, policy = tiny
    vocab = policy.model.config.vocab_size
    rnd = random.Random(3)
    ctx = [rnd.randrange(3, vocab) for _ in range(9)]
    sampling = Sampling(temperature=1.0, top_p=top_p)
    engine = ENGINES[kind]

    alone = GenRequest(list(ctx), 24, seed=1234)
    asyncio.run(_batched(engine(policy.replica(5), sampling=sampling), [alone], [0]))
    others = [
        GenRequest([rnd.randrange(3, vocab) for _ in range(rnd.randrange(1, 20))], rnd.randrange(4, 40), seed=i)
        for i in range(15)
    ]
    mine = GenRequest(list(ctx), 24, seed=1234)
    reqs = others[:7] + [mine] + others[7:]
    asyncio.run(_batched(engine(policy.replica(9), sampling=sampling), reqs, [rnd.randrange(0, 12) for _ in reqs]))
    assert len(alone.tokens) == 24 and mine.tokens == alone.tokens
    assert max(abs(a - b) for a, b in zip(mine.logprobs, alone.logprobs)) < 1e-5

    other_seed = GenRequest(list(ctx), 24, seed=4321)
    asyncio.run(_batched(engine(policy.replica(5), sampling=sampling), [other_seed], [0]))
    assert other_seed.tokens != alone.tokens


def _reference_inverse_cdf(row: list[float], u: float) -> int:
    """Slow obvious reference: walk the row until the running sum exceeds ``u`` times the total."""
    target, acc = u * math.fsum(row), 0.0
    for i, p in enumerate(row):
        acc += p
        if p > 0 and acc > target:
            return i
    return max(i for i, p in enumerate(row) if p > 0)


@settings(max_examples=40, deadline=None)
@given(st.randoms(use_true_random=False))
def test_inverse_cdf_equals_the_slow_reference_and_never_takes_a_zero(rnd):
    """Random rows with zeros in them (a nucleus cut, a masked token) and random numbers: the same token as the
    reference, always one of positive probability."""
    rows = [[rnd.choice([0.0, rnd.random()]) for _ in range(rnd.randrange(1, 12))] for _ in range(5)]
    width = max(map(len, rows))
    rows = [r + [0.0] * (width - len(r)) for r in rows]
    for r in rows:
        r[rnd.randrange(width)] = rnd.random() + 1e-3  # at least one positive entry per row
    us = [rnd.random() for _ in rows]
    got = inverse_cdf(torch.tensor(rows, dtype=torch.float32), us).tolist()
    f32 = [[float(torch.tensor(p, dtype=torch.float32)) for p in r] for r in rows]
    assert got == [_reference_inverse_cdf(r, u) for r, u in zip(f32, us)]
    assert all(rows[i][t] > 0 for i, t in enumerate(got))


def test_seeded_draws_follow_the_distribution():
    """4000 rows of one distribution, each with its own stream's first number: every token's frequency within
    4 standard errors of its probability (a biased or constant draw fails)."""
    probs = torch.tensor([0.5, 0.25, 0.125, 0.0, 0.125])
    n = 4000
    logits = probs.clamp(min=1e-30).log().expand(n, -1)
    toks, _ = sample(logits, 1.0, 1.0, torch.Generator(), [stream_uniform(s, 0) for s in range(n)])
    for tok, p in enumerate(probs.tolist()):
        freq = toks.count(tok) / n
        assert abs(freq - p) <= 4 * math.sqrt(p * (1 - p) / n) + 1e-12, (tok, freq, p)


def test_a_row_without_a_number_draws_from_the_shared_generator():
    """In a mixed batch a seeded row's token does not depend on the generator; an unseeded row's does."""
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(0))
    got = [sample(logits, 1.0, 1.0, torch.Generator().manual_seed(g), [0.37, None])[0] for g in range(8)]
    assert len({t[0] for t in got}) == 1
    assert len({t[1] for t in got}) > 1


def test_stream_seeds_depend_on_every_part_and_its_order():
    """Distinct names give distinct seeds (also when parts swap places); the numbers lie in [0, 1)."""
    names = [(7, g, m) for g in range(20) for m in range(8)] + [(7, m, g) for g in range(20) for m in range(8)]
    assert len({stream_seed(*n) for n in set(names)}) == len(set(names))
    assert stream_seed(1, 2) != stream_seed(2, 1) and stream_seed(5) == stream_seed(5)
    us = [stream_uniform(11, i) for i in range(2000)]
    assert all(0.0 <= u < 1.0 for u in us) and abs(sum(us) / len(us) - 0.5) < 0.02


def test_a_session_names_each_request_stream_by_turn_and_tokens_so_far():
    """Two turns of a session of seed S, the first interrupted after 4 tokens (a sync with interrupt_as_prompt) and
    continued as a new request: the engine sees seeds ``stream_seed(S, 0, 0)``, ``stream_seed(S, 0, 4)`` and
    ``stream_seed(S, 1, 0)``; a session without a seed sends none."""
    ctx = [1, 2, 3]

    async def main(seed):
        eng = FakeEngine(token_cost=0.1)
        store = ParameterStore(keep=4)
        store.publish(0, {"v": 0})
        pool = pool_of([eng], store, partial_rollout=True, interrupt_as_prompt=True)
        inst = pool.instances[0]
        seeds = []
        generate = inst.engine.generate

        async def recording(req):
            seeds.append(req.seed)
            return await generate(req)

        inst.engine.generate = recording
        pool.start()
        s = Session(pool, 0, ctx, seed=seed)

        async def publish():
            await asyncio.sleep(0.35)
            store.publish(1, {"v": 1})
            pool.notify_published()

        first, _ = await asyncio.gather(s.generate(ctx, 10), publish())
        await s.generate(ctx + first.tokens + [9], 3)
        await pool.stop()
        return seeds

    assert run_virtual(main(77)) == [stream_seed(77, 0, 0), stream_seed(77, 0, 4), stream_seed(77, 1, 0)]
    assert run_virtual(main(None)) == [None, None, None]
