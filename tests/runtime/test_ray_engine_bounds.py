"""The bounds on a Ray engine actor's calls (``psrl.runtime.ray_runtime``), without starting Ray: a start or a
control call that never answers ends as one :class:`EngineStuck` naming the instance, its node and the key to raise,
never a wait without end; a vLLM engine actor restarts (its server) where an ``hf`` one, which cannot, has no
``restart`` (the instance then gives it up, as locally). Awaitables stand in for Ray's refs (a ref is awaited the
same way)."""

from __future__ import annotations

import asyncio
from importlib.util import find_spec

import pytest

from psrl.rollout.engines.vllm_server import EngineSetupError
from psrl.runtime.ray_runtime import EngineStuck, RayEngine, RestartingRayEngine
from psrl.runtime.ray_weights import ObjectVersions


class _Method:
    """An actor method: ``.remote()`` counts the call and returns an awaitable that answers at once (or fails with
    ``error``), or never."""

    def __init__(self, answers: bool, value: object = None, error: Exception | None = None):
        self.answers, self.value, self.error, self.calls = answers, value, error, 0

    def remote(self, *args: object) -> asyncio.Future:
        self.calls += 1
        done = asyncio.get_running_loop().create_future()
        if self.error is not None:
            done.set_exception(self.error)
        elif self.answers:
            done.set_result(self.value)
        return done


class _RayTaskError(Exception):
    """What Ray raises for an actor method's exception: its own header first, the actor's error as ``cause``."""

    def __init__(self, cause: Exception):
        super().__init__("ray::EngineWorker.start() (pid=739, ip=127.0.0.1, actor_id=7370f0ad)")
        self.cause = cause


class _Actor:
    def __init__(self, silent: set[str] = frozenset()):
        for m in ("start", "pause", "resume", "abort_all", "restart"):
            setattr(self, m, _Method(m not in silent))


def _engine(actor: _Actor, kind: type[RayEngine] = RayEngine, **kw: object) -> RayEngine:
    name = "rollout instance 1 on node 5f3a9c0d1e2b"
    return kind(actor, ObjectVersions(), name=name, start_s=0.05, call_s=0.05, **kw)


@pytest.mark.parametrize(
    "silent, call, key",
    [
        ("start", lambda e: e.start(), "rollout.vllm.startup_timeout_s"),
        ("pause", lambda e: e.pause(), "rollout.request_timeout_s"),
        ("resume", lambda e: e.resume(), "rollout.request_timeout_s"),
        pytest.param(
            "abort_all",
            lambda e: e.abort_all(),
            "rollout.request_timeout_s",
            marks=pytest.mark.skipif(find_spec("ray") is None, reason="abort_all imports ray (a dead actor's error)"),
        ),
    ],
)
def test_a_call_the_actor_never_answers_is_one_error_naming_instance_node_and_key(silent, call, key):
    actor = _Actor(silent={silent})
    engine = _engine(actor, start_key="rollout.vllm.startup_timeout_s")
    with pytest.raises(EngineStuck) as err:
        asyncio.run(call(engine))
    msg = str(err.value)
    assert msg.startswith("rollout instance 1 on node 5f3a9c0d1e2b: no answer to ") and f"raise {key}" in msg, msg
    assert "\n" not in msg and getattr(actor, silent).calls == 1


def test_calls_answered_within_the_bound_pass():
    actor = _Actor()
    engine = _engine(actor)
    asyncio.run(engine.start())
    asyncio.run(engine.pause())
    asyncio.run(engine.resume())
    assert (actor.start.calls, actor.pause.calls, actor.resume.calls) == (1, 1, 1)


def test_a_vllm_engine_actor_restarts_and_then_holds_no_version_an_hf_one_cannot_restart():
    """The instance restarts an engine that has ``restart`` and loads the newest version after; one without is
    given up on (``RolloutInstance._recover``)."""
    actor = _Actor()
    engine = _engine(actor, RestartingRayEngine, version=4)
    asyncio.run(engine.restart())
    assert actor.restart.calls == 1 and engine.version == -1
    assert not hasattr(_engine(_Actor()), "restart")
    with pytest.raises(EngineStuck, match="no answer to restart"):
        asyncio.run(_engine(_Actor(silent={"restart"}), RestartingRayEngine).restart())


def test_an_engine_that_fails_to_start_in_its_actor_is_its_own_one_line_error_not_rays_header():
    """The run's one line is the engine's message (``psrl.errors``), not Ray's ``ray::EngineWorker.start() (pid=...)``;
    an error that is not psrl's stays Ray's."""
    failed = EngineSetupError("the vLLM server on port 40511 exited with code 1 before it was healthy")
    actor = _Actor()
    actor.start = _Method(False, error=_RayTaskError(failed))
    with pytest.raises(EngineSetupError) as err:
        asyncio.run(_engine(actor).start())
    assert err.value is failed
    actor.start = _Method(False, error=_RayTaskError(ValueError("not psrl's")))
    with pytest.raises(_RayTaskError):
        asyncio.run(_engine(actor).start())
