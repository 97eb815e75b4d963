"""The trainer sees each batch in a canonical order: groups by reservation, members by index (issue 34).

``consume`` returns groups in occupy order and members in completion order (the staleness spec's order, which
timing decides); the coordinator sorts outside ``psrl.staleness`` so a run whose samples do not depend on timing
trains on the same sums in the same order.
"""

from psrl.rollout.fakes import FakeTask
from psrl.runtime.coordinator import canonical_order
from psrl.staleness import Batch
from psrl.types import Trajectory
from tests.rollout.harness import config, coordinator, run


def _group(g: int, members: list[int]) -> list[Trajectory]:
    return [Trajectory(f"g{g}-{i}", f"g{g}", 0, [1]) for i in members]


def test_groups_by_entry_members_by_index_numbers_as_numbers():
    """Entries 10 and 9, members 2, 0, 10, 1: entry 9 first, and member 10 after member 2 (not after 1)."""
    batch = Batch(3, [_group(10, [2, 0, 10, 1]), _group(9, [1, 0])], [10, 9], [3, 2])
    out = canonical_order(batch)
    assert out.version == 3 and out.entries == [9, 10] and out.group_versions == [2, 3]
    assert [[t.uid for t in g] for g in out.groups] == [["g9-0", "g9-1"], ["g10-0", "g10-1", "g10-2", "g10-10"]]
    assert batch.entries == [10, 9]  # the consumed batch itself is left as it was


def test_the_trainer_gets_batches_in_canonical_order_when_later_members_finish_first():
    """Every episode's tool call is shorter than the one started before it, so the last group reserved fills
    first and members complete last-launched first: the batches the trainer got are sorted all the same."""
    task = FakeTask(turns=2, turn_tokens=2, latency_fn=lambda prompt, episode_no, call: 50.0 - episode_no)
    coord = coordinator(config(psrl__staleness=0, psrl__rollout_n=3), task)
    run(coord, 3)
    batches = coord.trainer.batches
    assert len(batches) == 3
    for b in batches:
        assert b.entries == sorted(b.entries) and len(b.entries) > 1
        for g in b.groups:
            idx = [int(t.uid.rsplit("-", 1)[1]) for t in g]
            assert idx == sorted(idx) and len(idx) == 3
