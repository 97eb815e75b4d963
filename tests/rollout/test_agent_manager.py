"""The agent manager acting on every status: cancellation, filters, proactive retry / truncate, failures.

Every test runs the real Coordinator on fake engines in virtual time. ``latency_fn`` is keyed by
``episode_no`` (episodes in start order), so one chosen attempt can be made slow; groups take
prompts in dispatch order, so group ``g<k>`` answers prompt ``k``.
"""

import asyncio
from collections import defaultdict

import pytest

from psrl.rollout.fakes import FakeTask
from tests.rollout.harness import check_bound, config, coordinator, run


def slow_episodes(slow: set, slow_latency: float = 1e6, fast: float = 1.0, each: dict | None = None):
    """A latency_fn: episodes in ``slow`` wait ``slow_latency`` on their tool call, those in ``each``
    their own value, others ``fast``."""
    each = dict(each or {})

    def latency(prompt, episode_no, call):
        return slow_latency if episode_no in slow else each.get(episode_no, fast)

    return latency


def by_uid(records):
    return {r["uid"]: r for r in records}


def account(coord):
    """Nothing lost silently: every completed trajectory has exactly one record (errors are extra records)."""
    recs = coord.sink.trajectories
    uids = [r["uid"] for r in recs]
    assert len(uids) == len(set(uids)), "a trajectory was recorded twice"
    assert sum(r["status"] != "error" for r in recs) == coord.agents.counts.generated


def step_rows(coord):
    return coord.sink.metrics


# ---------------------------------------------------------------------------- cancellation


def test_occupied_group_cancels_its_surplus_member_at_once():
    """N'=2 > N=1: when the fast member occupies, the slow one is cancelled before the step (never completes)."""
    cfg = config(
        psrl__staleness=0,
        psrl__staleness_buffer_entries=1,
        psrl__rollout_n=1,
        psrl__redundant_rollout__enable=True,
        psrl__redundant_rollout__redundant_rollout_n=2,
    )
    coord = coordinator(cfg, FakeTask(latency_fn=slow_episodes({1})))
    rows = run(coord, 1)
    recs = by_uid(coord.sink.trajectories)
    assert recs["g0-0"]["status"] == "trained" and "g0-1" not in recs
    assert rows[0]["counts/cancelled"] == 1 and rows[0]["time"] < 10
    account(coord)


def test_passively_aborted_entry_is_cancelled_and_its_held_members_reported():
    """B'=2 > B=1: once buffer 0 is full the other reserved group is passively aborted.

    Group 1's first member (episode 2) completes at t~1, group 0 fills at t~2 (episode 1), so group 1
    is aborted holding one member: its slow member (episode 3) is cancelled at once and the member
    it already held is recorded ``aborted`` -- reported, not silently dropped.
    """
    cfg = config(
        psrl__staleness=0,
        psrl__staleness_buffer_entries=1,
        psrl__rollout_n=2,
        psrl__redundant_rollout__enable=True,
        psrl__redundant_rollout__redundant_global_batch_size=2,
    )
    coord = coordinator(cfg, FakeTask(latency_fn=slow_episodes({3}, each={1: 2.0})))
    rows = run(coord, 1)
    recs = by_uid(coord.sink.trajectories)
    assert recs["g0-0"]["status"] == recs["g0-1"]["status"] == "trained"
    assert recs["g1-0"]["status"] == "aborted" and "g1-1" not in recs
    assert rows[0]["counts/aborted"] == 1 and rows[0]["counts/cancelled"] == 1
    assert rows[0]["time"] < 10
    account(coord)


# ---------------------------------------------------------------------------- dynamic sampling filter


def test_dynamic_sampling_filter_drops_zero_std_groups_and_slots_refill():
    """Groups of even prompts all score 1 (zero std): filtered and reported; training still gets full batches."""

    def score(prompt, episode):
        return 1.0 if prompt.answer % 2 == 0 else float(episode.info["coin"] > 0.5)

    cfg = config(
        psrl__group_post_process__enable=True,
        psrl__group_post_process__name="dynamic_sampling_filter",
        algorithm__filter_groups__metric="score",
        psrl__rollout_n=3,
    )
    coord = coordinator(cfg, FakeTask(score_fn=score, tool_latency=0.5))
    rows = run(coord, 4)
    groups = defaultdict(list)
    for r in coord.sink.trajectories:
        groups[(r["group"], r["status"])].append(r["reward"])
    trained = {g: v for (g, s), v in groups.items() if s == "trained"}
    filtered = {g: v for (g, s), v in groups.items() if s == "filtered"}
    assert len(trained) == 4 * 2 and all(len(set(v)) > 1 for v in trained.values())
    assert filtered and all(len(set(v)) == 1 and len(v) == 3 for v in filtered.values())
    assert {int(g[1:]) % 2 for g in filtered} >= {0}
    assert rows[-1]["counts/filtered"] == sum(len(v) for v in filtered.values())
    account(coord)


# ---------------------------------------------------------------------------- proactive filter on STUCK buffers


def stuck_config(method):
    """eta=0, B=2, N=1: both groups reserve into buffer 0, which is STUCK (full) until both complete."""
    return config(
        psrl__staleness=0,
        psrl__staleness_buffer_entries=2,
        psrl__rollout_n=1,
        psrl__proactive_filter_strategy__method=method,
        psrl__proactive_filter_strategy__threshold=1,
        trainer__stall_timeout_s=0,
    )  # the control waits 1e6 s on purpose: no stall watchdog


def test_without_a_proactive_filter_a_stuck_buffer_waits_for_its_straggler():
    """Control: method null waits the full 1e6 s tool call of episode 1 (virtual time, so it is cheap)."""
    coord = coordinator(stuck_config(None), FakeTask(latency_fn=slow_episodes({1})))
    rows = run(coord, 1)
    assert rows[0]["time"] >= 1e6
    assert by_uid(coord.sink.trajectories)["g1-0"]["status"] == "trained"


def test_proactive_retry_redispatches_the_straggler_and_unblocks_the_buffer():
    """retry: the slow member is cancelled and its prompt re-dispatched to a fresh worker, which is fast."""
    coord = coordinator(stuck_config("retry"), FakeTask(latency_fn=slow_episodes({1})))
    rows = run(coord, 1)
    recs = by_uid(coord.sink.trajectories)
    assert rows[0]["time"] < 10
    assert "g1-0" not in recs and recs["g1-1"]["status"] == "trained"
    assert rows[0]["counts/retried"] == 1 and rows[0]["counts/cancelled"] == 1
    assert check_bound(coord.sink.trajectories, eta=0) == 2
    account(coord)


def test_proactive_truncate_force_completes_the_straggler_with_its_partial_output():
    """truncate: the slow member completes at once with its first turn only, marked truncated."""
    task = FakeTask(turns=2, turn_tokens=4, latency_fn=slow_episodes({1}))
    coord = coordinator(stuck_config("truncate"), task)
    rows = run(coord, 1)
    recs = by_uid(coord.sink.trajectories)
    assert rows[0]["time"] < 10
    cut, full = recs["g1-0"], recs["g0-0"]
    assert cut["status"] == "trained" and cut["truncated"] and not full["truncated"]
    assert cut["response_len"] == 4 < full["response_len"] == 4 + 2 + 4
    assert rows[0]["counts/truncated"] == 1
    assert check_bound(coord.sink.trajectories, eta=0) == 2
    account(coord)


@pytest.mark.parametrize("fails", [1, 2])
def test_proactive_truncate_retries_a_raising_synchronous_reward_like_any_other(fails):
    """The truncated straggler's (synchronous) reward raises ``fails`` times: with task.reward_retries=1 one
    failure is retried and the cut trajectory trains; two are reported (status error) and its entry aborted."""
    calls = defaultdict(int)

    def reward(prompt, episode):
        if episode.truncated:
            calls[prompt.uid] += 1
            if calls[prompt.uid] <= fails:
                raise RuntimeError("flaky verifier")
        return {"score": 1.0, "acc": 1.0, "seq_reward": 1.0, "seq_final_reward": 1.0}

    task = FakeTask(turns=2, turn_tokens=4, latency_fn=slow_episodes({1}), reward_fn=reward)
    coord = coordinator(stuck_config("truncate"), task)
    rows = run(coord, 1)
    recs = by_uid(coord.sink.trajectories)
    assert rows[0]["time"] < 10 and rows[0]["counts/error_retries"] == 1
    if fails == 1:
        assert recs["g1-0"]["status"] == "trained" and recs["g1-0"]["truncated"]
        assert rows[0]["counts/truncated"] == 1 and rows[0]["counts/failed"] == 0
    else:
        assert recs["g1-0"]["status"] == "error" and "reward" in recs["g1-0"]["error"]
        assert rows[0]["counts/truncated"] == 0 and rows[0]["counts/failed"] == 1


@pytest.mark.parametrize("threshold, acts", [(0, False), (1, False), (2, True)])
def test_proactive_filter_acts_only_at_or_below_its_threshold(threshold, acts):
    """Boundary: B=3 with two stragglers left in the STUCK buffer -- threshold 2 acts, threshold 1 waits.
    0 is PSRL's default: a STUCK buffer always has a RESERVED entry, so the filter never acts."""
    cfg = config(
        psrl__staleness=0,
        psrl__staleness_buffer_entries=3,
        psrl__rollout_n=1,
        psrl__proactive_filter_strategy__method="truncate",
        psrl__proactive_filter_strategy__threshold=threshold,
        trainer__stall_timeout_s=0,
    )
    coord = coordinator(cfg, FakeTask(latency_fn=slow_episodes({1, 2})))
    rows = run(coord, 1)
    assert (rows[0]["counts/truncated"] == 2) is acts
    assert (rows[0]["time"] < 10) is acts


# ---------------------------------------------------------------------------- failing reward / agent loop


def test_transient_reward_error_is_retried_once_and_then_succeeds():
    """A reward function that raises once is retried (task.reward_retries=1); nothing is reported."""
    calls = defaultdict(int)

    def reward(prompt, episode):
        calls[prompt.uid] += 1
        if prompt.answer == 0 and calls[prompt.uid] == 1:
            raise RuntimeError("flaky verifier")
        return {"score": 1.0, "acc": 1.0, "seq_reward": 1.0, "seq_final_reward": 1.0}

    coord = coordinator(config(), FakeTask(reward_fn=reward))
    rows = run(coord, 2)
    assert rows[-1]["counts/error_retries"] == 1 and rows[-1]["counts/failed"] == 0
    assert all(r["status"] != "error" for r in coord.sink.trajectories)
    account(coord)


@pytest.mark.parametrize("stage", ["reward", "episode"])
def test_persistent_failure_is_reported_and_the_entry_aborted(stage):
    """Prompt 1 always raises: after one retry it is reported (status error), its entry aborted, training goes on."""

    def reward(prompt, episode):
        if stage == "reward" and prompt.answer == 1:
            raise ValueError("broken verifier")
        return {"score": 0.0, "acc": 0.0, "seq_reward": 0.0, "seq_final_reward": 0.0}

    def episode(prompt):
        if stage == "episode" and prompt.answer == 1:
            raise ValueError("tool crashed")

    task = FakeTask(reward_fn=reward, episode_fn=episode)
    coord = coordinator(config(), task)
    rows = run(coord, 3)
    errors = [r for r in coord.sink.trajectories if r["status"] == "error"]
    assert [r["group"] for r in errors] == ["g1"] and stage in errors[0]["error"]
    assert errors[0]["prompt"] == "prompt 1"
    assert rows[-1]["counts/failed"] == 1 and rows[-1]["counts/aborted"] >= 1
    assert rows[-1]["counts/error_retries"] >= 1
    assert not any(r["group"] == "g1" and r["status"] == "trained" for r in coord.sink.trajectories)
    assert len(rows) == 3
    account(coord)


def _bad_reward(kind: str):
    """A reward that fails for prompt 1 as ``kind`` says: hang (async, never returns), nan, inf, raise."""

    def ok():
        return {"score": 0.0, "acc": 0.0, "seq_reward": 0.0, "seq_final_reward": 0.0}

    def reward(prompt, episode):
        if prompt.answer != 1:
            return ok()
        if kind == "hang":

            async def never():
                await asyncio.get_running_loop().create_future()  # nothing ever sets it

            return never()
        if kind == "raise":
            raise ValueError("broken verifier")
        value = float(kind)
        return {"score": value, "acc": 0.0, "seq_reward": value, "seq_final_reward": value}

    return reward


def no_buffer_waits_on(coord, groups: set) -> None:
    """Every entry still blocking a live buffer belongs to a group the agent manager still runs, and none
    to a failed one: a failed entry was aborted through the protocol, so it can never hold a buffer."""
    live = {g.eid: g.uid for g in coord.agents.groups.values()}
    for b in coord.manager.buffer_states():
        for eid in coord.manager.blocking(b):
            assert eid in live, f"buffer {b} waits on entry {eid} that nothing generates"
            assert live[eid] not in groups, f"buffer {b} waits on failed group {live[eid]}"


@pytest.mark.parametrize(
    "kind, reason",
    [
        ("hang", "task.reward_timeout=30s"),
        ("nan", "nan"),
        ("inf", "inf"),
        ("-inf", "-inf"),
        ("raise", "broken verifier"),
    ],
)
def test_hanging_or_non_finite_reward_fails_like_a_raising_one(kind, reason):
    """Prompt 1's reward hangs (virtual time: it is cancelled at task.reward_timeout) or scores NaN / +-inf:
    retried once, then recorded ``error`` with the reason, counted in counts/failed, its entry aborted
    through the protocol, and training goes on with no buffer waiting on it."""
    coord = coordinator(config(), FakeTask(reward_fn=_bad_reward(kind)))
    rows = run(coord, 3)
    errors = [r for r in coord.sink.trajectories if r["status"] == "error"]
    assert {r["group"] for r in errors} == {"g1"} and all(reason in r["error"] for r in errors), errors
    assert rows[-1]["counts/failed"] == len(errors) >= 1
    assert rows[-1]["counts/error_retries"] >= 1 and rows[-1]["counts/aborted"] >= 1
    assert not any(r["group"] == "g1" and r["status"] == "trained" for r in coord.sink.trajectories)
    assert len(rows) == 3 and check_bound(coord.sink.trajectories, 1) == 3 * 2 * 2
    no_buffer_waits_on(coord, {"g1"})
    account(coord)
