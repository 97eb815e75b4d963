"""One conformance suite for the engine interface (:class:`psrl.types.Engine`), run unchanged on every engine.

``fake``: the no-cache twin over :class:`FakeEngine` (deterministic tokens, log-prob encodes the
version); ``hf``: the KV-cached in-process engine over the default model; ``vllm``: a vLLM server
of the same model (``-m vllm``; skipped with the reason when the vLLM environment is absent).

Waiting for an engine to have produced a token uses :func:`until`, a bounded wait on a condition.
"""

import asyncio
import copy
import warnings

import pytest
import torch

from psrl.rollout.engines.base import NoCacheEngine
from psrl.rollout.engines.hf import HFEngine
from psrl.rollout.fakes import FakeEngine
from psrl.types import Engine, EngineLoad, GenRequest, Sampling
from psrl.weights import FileVersions, ParameterStore, publish_model

ENGINES = ["fake", "hf", pytest.param("vllm", marks=pytest.mark.vllm)]
CTX = [1, 5, 6, 7]
LONG = {"fake": 120, "hf": 120, "vllm": 4000}
"""Budget of the requests a test pauses or aborts mid-flight: long enough that a pause or an abort lands
while they run (vLLM serves the tiny model at up to ~2000 tokens a second; on a loaded machine a 1000-token
request ended before the test process had polled the server twice)."""
MANY = {"fake": 6, "hf": 6, "vllm": 8}
"""Requests such a test runs at once (on vLLM, see :func:`generating` for what is waited for)."""


async def until(cond, timeout: float = 120.0) -> None:
    """Return once ``cond()`` holds; fail the test after ``timeout`` seconds (no unbounded wait)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not cond():
        assert loop.time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.005)


async def generating(rig, reqs) -> None:
    """Return once the engine is generating ``reqs``. In-process (exact): each has 2 tokens. On vLLM: the
    server has begun at least one of them, by its own count (``vllm:num_requests_running`` of ``/metrics``)
    or by a first chunk streamed to us, whichever shows first. Neither proves the request is still running
    on the server: on this 2-core machine the server's API process streams a request's tokens, and renders
    ``/metrics``, seconds behind its engine (measured: a 4000-token request's first chunk arriving with its
    last, 9 s after it was sent), so what a test does next may land after the request ended there. Tests
    that need it to land mid-request run through :func:`until_landed`."""
    if rig.kind != "vllm":
        await until(lambda: all(len(r.tokens) >= 2 for r in reqs))
        return
    import httpx

    from psrl.rollout.engines.vllm_http import gauge

    loop = asyncio.get_running_loop()
    deadline = loop.time() + 120.0
    while not any(r.tokens for r in reqs):
        try:
            text = (await rig.engine._client.get(f"{rig.engine.url}/metrics", timeout=10.0)).text
        except httpx.TransportError:  # a pooled connection the server closed as we sent (docs/engines.md, Faults)
            text = ""
        if (gauge(text, "vllm:num_requests_running") or 0) >= 1:
            return
        assert loop.time() < deadline, "the server ran none of the requests in time"
        await asyncio.sleep(0.1)  # /metrics is rendered by the server's one event loop: polled faster, it starves


VLLM_ATTEMPTS = 3


def until_landed(kind, once, landed):
    """``once(attempt)`` (a whole scenario on a fresh rig), run again while ``landed(outcome)`` is false: up to
    :data:`VLLM_ATTEMPTS` times on vLLM, where the server may finish a request before an abort or a pause
    sent mid-stream reaches it (see :func:`generating`); once in-process, where the timing is exact. Returns
    the outcome that landed, for the test to assert on. In-process a run that did not land is returned (and
    fails its asserts); on vLLM, where landing is up to the server's timing, the test is skipped with the reason
    when no attempt landed: the abort and pause calls themselves are checked against a scripted server in
    ``test_vllm_client.py``, and here whenever the race is won."""
    attempts = VLLM_ATTEMPTS if kind == "vllm" else 1
    for attempt in range(attempts):
        outcome = once(attempt)
        if landed(outcome):
            return outcome
        if attempt + 1 < attempts:  # shown in pytest's warnings summary: how often the race is lost
            warnings.warn(
                f"attempt {attempt + 1} of {attempts}: the server finished first; running again", stacklevel=2
            )
    if kind == "vllm":  # the precondition was never reached: nothing was checked, which is not a pass
        pytest.skip(f"the server finished before the abort/pause landed in all {attempts} attempts (see generating)")
    return outcome


class Rig:
    """An engine of one kind plus what the checks need: the store it loads from, and a policy to compare with."""

    def __init__(self, kind, tiny, request, tmp_path, stop_ids=(), temperature=1.0):
        cfg, task, policy = tiny
        self.kind = kind
        self.policy = copy.deepcopy(policy)
        self.store: ParameterStore | FileVersions = ParameterStore(keep=4)
        self.vocab = 97 if kind == "fake" else self.policy.model.config.vocab_size
        sampling = Sampling(temperature=temperature, stop_ids=frozenset(stop_ids))
        if kind == "fake":
            # 5 ms a row: polls see progress
            self.engine = NoCacheEngine(FakeEngine(token_cost=0.005), sampling=sampling)
            self.store.publish(1, {"v": 1})
        elif kind == "hf":
            self.engine = HFEngine(self.policy.replica(seed=3), sampling=sampling)
            self.store.publish(1, self.policy.export_state())
        else:
            from psrl.rollout.engines.vllm import VLLMEngine

            url = request.getfixturevalue("vllm_urls")[0]
            self.engine = VLLMEngine(url=url, sampling=sampling)
            self.store = FileVersions(tmp_path / "weights")  # vLLM reads the directories the ranks would write
            self._publish(1)

    async def __aenter__(self):
        await self.engine.start()
        await self.engine.update_weights(1, self.store)
        return self

    async def __aexit__(self, *exc):
        await self.engine.close()

    def publish_perturbed(self, version: int, scale: float = 0.05) -> None:
        """Publish ``version``: the policy's weights moved by a seeded perturbation (the fake: a marker)."""
        if self.kind == "fake":
            self.store.publish(version, {"v": version})
            return
        gen = torch.Generator().manual_seed(version)
        with torch.no_grad():
            for w in self.policy.model.parameters():
                w.add_(torch.randn(w.shape, generator=gen) * scale)
        self.policy.version = version
        self._publish(version)

    def _publish(self, version: int) -> None:
        """Publish the rig's policy as ``version`` where its engine reads it (:mod:`psrl.weights`)."""
        if isinstance(self.store, FileVersions):
            publish_model(self.policy.model, self.store.root, version, keep=4)
        else:
            self.store.publish(version, self.policy.export_state())

    def recompute(self, req: GenRequest, policy=None) -> list[float]:
        """The trainer's log-probs of ``req``'s tokens under ``policy`` (default: the rig's current weights)."""
        with torch.no_grad():
            return (policy or self.policy).sequence_logprobs([req.context], [req.tokens])[0].tolist()


def run(coro):
    return asyncio.run(coro)


@pytest.mark.parametrize("kind", ENGINES)
def test_engine_satisfies_the_protocol(kind, tiny, request, tmp_path):
    """Every engine is a psrl.types.Engine and reports its load as an EngineLoad."""
    rig = Rig(kind, tiny, request, tmp_path)
    assert isinstance(rig.engine, Engine)

    async def main():
        async with rig:
            return rig.engine.load(), rig.engine.version

    load, version = run(main())
    assert isinstance(load, EngineLoad) and load.running == 0 and version == 1


@pytest.mark.parametrize("kind", ENGINES)
def test_generate_fills_tokens_logprobs_versions_within_the_budget(kind, tiny, request, tmp_path):
    """Budget obeyed exactly without stop ids; one log-prob (<= 0) and one version per token."""
    rig = Rig(kind, tiny, request, tmp_path)

    async def main():
        async with rig:
            reqs = [GenRequest(CTX + [i % 5 + 5], n) for i, n in enumerate([1, 7, 12, 3])]
            await asyncio.gather(*(rig.engine.generate(r) for r in reqs))
            return reqs

    for req in run(main()):
        assert req.finish == "length" and len(req.tokens) == req.max_new_tokens
        assert len(req.logprobs) == len(req.tokens) and all(lp <= 0 for lp in req.logprobs)
        assert req.versions == [1] * len(req.tokens)
        assert all(0 <= t < rig.vocab for t in req.tokens)


@pytest.mark.parametrize("kind", ENGINES)
def test_a_stop_token_ends_the_request_and_is_kept(kind, tiny, request, tmp_path):
    """With every token a stop token, each request ends after exactly one token, finish 'stop'."""
    cfg, task, policy = tiny
    vocab = 97 if kind == "fake" else policy.model.config.vocab_size
    rig = Rig(kind, tiny, request, tmp_path, stop_ids=range(vocab))

    async def main():
        async with rig:
            req = GenRequest(list(CTX), 10)
            await rig.engine.generate(req)
            return req

    req = run(main())
    assert req.finish == "stop" and len(req.tokens) == 1


@pytest.mark.parametrize("kind", ["hf", pytest.param("vllm", marks=pytest.mark.vllm)])
def test_behaviour_logprobs_equal_the_trainers_recomputation(kind, tiny, request, tmp_path):
    """Sampled at temperature 1, each token's behaviour log-prob is what the trainer recomputes (same weights)."""
    rig = Rig(kind, tiny, request, tmp_path)

    async def main():
        async with rig:
            reqs = [GenRequest(CTX[: 2 + i], 20) for i in range(3)]
            await asyncio.gather(*(rig.engine.generate(r) for r in reqs))
            return reqs

    tol = 1e-5 if kind == "hf" else 1e-4
    for req in run(main()):
        diff = max(abs(a - b) for a, b in zip(req.logprobs, rig.recompute(req)))
        assert diff < tol, diff


@pytest.mark.parametrize("kind", ENGINES)
def test_abort_one_request_returns_its_tokens_so_far_and_spares_the_others(kind, tiny, request, tmp_path):
    """Passive abort: the aborted request keeps what it generated (finish 'abort'); the other one, running
    beside it, finishes."""

    async def main(rig):
        async with rig:
            victim, other = GenRequest(list(CTX), LONG[kind]), GenRequest(list(CTX), 30)
            tv = asyncio.ensure_future(rig.engine.generate(victim))
            await generating(rig, [victim])
            to = asyncio.ensure_future(rig.engine.generate(other))
            rig.engine.abort(victim)
            await asyncio.gather(tv, to)
            return victim, other

    victim, other = until_landed(
        kind, lambda i: run(main(Rig(kind, tiny, request, tmp_path / str(i)))), lambda out: out[0].finish == "abort"
    )
    # on vLLM the server's first step of a request already samples its first token
    assert victim.finish == "abort" and (2 if kind != "vllm" else 1) <= len(victim.tokens) < LONG[kind]
    assert len(victim.logprobs) == len(victim.versions) == len(victim.tokens)
    assert other.finish == "length" and len(other.tokens) == 30


@pytest.mark.parametrize("kind", ENGINES)
def test_abort_all_returns_every_request_with_its_tokens(kind, tiny, request, tmp_path):
    """Migration: paused, then abort_all; every request still in flight comes back aborted with its partial
    output. On vLLM a request may finish on the server before the pause lands (it comes back finished
    although it still counted as in flight), or not have reached the server yet (it comes back aborted with
    no tokens); at least one the server was running comes back aborted with its tokens."""

    async def main(rig):
        async with rig:
            reqs = [GenRequest(list(CTX), LONG[kind]) for _ in range(MANY[kind])]
            tasks = [asyncio.ensure_future(rig.engine.generate(r)) for r in reqs]
            await generating(rig, reqs)
            await rig.engine.pause()
            running = rig.engine.load().running
            await rig.engine.abort_all()
            await asyncio.gather(*tasks)
            await rig.engine.resume()
            return reqs, running, rig.engine.load()

    reqs, running, load = until_landed(
        kind,
        lambda i: run(main(Rig(kind, tiny, request, tmp_path / str(i)))),
        lambda out: any(r.finish == "abort" and r.tokens for r in out[0]),
    )
    aborted = [r for r in reqs if r.finish == "abort"]
    assert load.running == 0 and 1 <= len(aborted) <= running and any(r.tokens for r in aborted)
    assert all(len(r.tokens) < LONG[kind] and len(r.logprobs) == len(r.versions) == len(r.tokens) for r in aborted)
    assert all(r.finish == "length" and len(r.tokens) == LONG[kind] for r in reqs if r not in aborted)
    if kind != "vllm":  # in-process the pause is exact: every request is still in flight and is aborted
        assert len(aborted) == running == len(reqs)


@pytest.mark.parametrize("kind", ENGINES)
def test_pause_update_resume_keeps_requests_and_new_tokens_carry_the_new_version(kind, tiny, request, tmp_path):
    """Partial rollout: paused with requests kept, weights updated to v2, resumed; every request completes and
    its versions step from 1 to 2 at most once, never back, and each label names the weights that produced
    the token. In-process the pause is exact (every request spans both versions, nothing produced while
    paused). On vLLM the labels are the server's own (a token produced before the pause but streamed to us
    after the resume still says 1); the requests the server was running when the pause reached it go on
    after the resume with version-2 tokens."""

    async def main(rig):
        async with rig:
            reqs = [GenRequest(list(CTX), LONG[kind]) for _ in range(MANY[kind])]
            tasks = [asyncio.ensure_future(rig.engine.generate(r)) for r in reqs]
            await generating(rig, reqs)
            await rig.engine.pause()
            before = [len(r.tokens) for r in reqs]
            v1 = copy.deepcopy(rig.policy)
            rig.publish_perturbed(2, scale=0.2)
            await rig.engine.update_weights(2, rig.store)
            during = [len(r.tokens) for r in reqs]
            await rig.engine.resume()
            await asyncio.gather(*tasks)
            return rig, reqs, before, during, v1

    def spanning(reqs):
        return sum(r.versions[0] == 1 and r.versions[-1] == 2 for r in reqs if r.versions)

    rig, reqs, before, during, v1 = until_landed(
        kind, lambda i: run(main(Rig(kind, tiny, request, tmp_path / str(i)))), lambda out: spanning(out[1]) >= 1
    )
    assert rig.engine.version == 2
    spans = 0
    for req, b, d in zip(reqs, before, during):
        assert req.finish == "length" and len(req.tokens) == LONG[kind]
        assert req.versions == sorted(req.versions) and set(req.versions) <= {1, 2}
        assert req.versions.count(1) >= (2 if kind != "vllm" else d)  # vLLM: one may not have started
        spans += req.versions[0] == 1 and req.versions[-1] == 2
        if kind != "vllm":  # in-process: the pause is exact, nothing is produced while paused
            assert b == d == req.versions.count(1) and req.versions[-1] == 2
    assert spans >= 1
    if kind != "fake":  # v1's tokens have v1's log-probs, those labelled 2 do not
        diffs = [(v, abs(a - b)) for req in reqs for v, a, b in zip(req.versions, req.logprobs, rig.recompute(req, v1))]
        assert max(d for v, d in diffs if v == 1) < (1e-5 if kind == "hf" else 1e-4)
        v2 = [d for v, d in diffs if v == 2]
        assert sum(v2) / len(v2) > 1e-2


@pytest.mark.parametrize("kind", ENGINES)
def test_update_weights_when_idle_changes_the_version_of_new_tokens(kind, tiny, request, tmp_path):
    """An idle engine loads v2; the next request's tokens carry version 2 (and, hf/vllm, v2's log-probs)."""
    rig = Rig(kind, tiny, request, tmp_path)

    async def main():
        async with rig:
            rig.publish_perturbed(2, scale=0.2)
            await rig.engine.update_weights(2, rig.store)
            req = GenRequest(list(CTX), 10)
            await rig.engine.generate(req)
            return req

    req = run(main())
    assert req.versions == [2] * 10
    if kind != "fake":
        tol = 1e-5 if kind == "hf" else 1e-4
        assert max(abs(a - b) for a, b in zip(req.logprobs, rig.recompute(req))) < tol


@pytest.mark.parametrize("migration", [False, True])
@pytest.mark.parametrize("kind", ENGINES)
def test_a_rollout_instance_syncs_mid_request_and_counts_it(kind, migration, tiny, request, tmp_path):
    """The instance's partial-rollout sync on every engine, with requests provably in flight when the new
    version is published: without migration they continue across pause/update/resume (versions step 1 -> 2,
    counted in ``continued``); with migration they are handed back unfinished with their tokens and V_traj
    (``interrupted``) while the instance loads. In-process every request is caught by the pause; on vLLM v2 is
    published once the server runs one of them (:func:`generating`), and at least one is caught. The
    end-to-end runs on vLLM cannot force an update to land mid-request, so this is where both counts are
    checked."""
    from psrl.rollout.serving.instance import RolloutInstance
    from psrl.rollout.serving.sync import GreedySync

    n = MANY[kind]

    async def main(rig):
        inst = RolloutInstance(
            0, rig.engine, rig.store, GreedySync(), partial_rollout=True, interrupt_as_prompt=migration
        )
        inst.start()
        try:
            await asyncio.wait_for(inst.ready.wait(), 300)
            reqs = [inst.submit(list(CTX), LONG[kind], v_min=1) for _ in range(n)]
            await generating(rig, reqs)
            rig.publish_perturbed(2)
            inst.wake()
            await asyncio.wait_for(asyncio.gather(*[r.future for r in reqs]), 300)
            await until(lambda: inst.loads == 1)  # the pull (pause, update, resume) has completed
            return inst, reqs
        finally:
            await inst.stop()

    def caught_in(reqs):
        return [r for r in reqs if r.interrupted or (r.versions and r.versions[-1] == 2)]

    def landed(out):  # with migration, a request handed back must have had tokens (on vLLM one may be queued)
        caught = caught_in(out[1])
        return len(caught) >= 1 and (not migration or any(r.versions for r in caught))

    inst, reqs = until_landed(kind, lambda i: run(main(Rig(kind, tiny, request, tmp_path / str(i)))), landed)
    assert inst.version == 2
    caught = caught_in(reqs)
    # In-process the pause is exact: every request is caught. On vLLM a request may finish on the server
    # before the pause reaches it.
    assert len(caught) == n if kind != "vllm" else len(caught) >= 1
    for req in reqs:
        assert req.v_min == 1 and req.versions == sorted(req.versions)
        assert req.versions[:2] == [1, 1] or kind == "vllm"  # on vLLM one may not have started by the pause
        assert len(req.versions) == len(req.tokens) == len(req.logprobs)
        assert req.finish == ("abort" if req.interrupted else "length")
        assert len(req.tokens) == LONG[kind] or req.interrupted
    if migration:
        assert inst.continued == 0 and inst.interrupted == len(caught) >= 1
        assert all(set(r.versions) <= {1} for r in caught) and any(r.versions for r in caught)
    else:
        assert inst.interrupted == 0 and inst.continued >= max(len(caught), 1)  # counted at the pause
        assert not any(r.interrupted for r in reqs)
