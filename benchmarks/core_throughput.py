"""Cost per trajectory of Reserve -> Complete -> Consume, next to a queue.Queue put+get, in one run.

One round at G groups in flight: reserve G entries (staleness 3, so reservations spread over four
buffers by worst-case placement and fall-back), hand in all G x N trajectories in a shuffled order
(so thousands of entries are partially complete at once), then consume the four buffers. The
baseline puts the same G x N items into a ``queue.Queue`` and gets them back. Both are timed
alternately in the same process, best of several repeats (the machine is shared and noisy).

    python benchmarks/core_throughput.py [--repeats 7]
"""

from __future__ import annotations

import argparse
import json
import queue
import random
import time

from psrl.staleness import StalenessManager

ETA, N = 3, 8


def staleness_round(m: StalenessManager, G: int, order: list[int]) -> None:
    v = m.train_version
    ids = [m.try_reserve(v) for _ in range(G)]
    complete = m.complete
    for i in order:
        complete(ids[i], i, v)
    for _ in range(ETA + 1):
        m.consume()


def queue_round(items: list[int]) -> None:
    q: queue.Queue = queue.Queue()
    for x in items:
        q.put(x)
    for _ in items:
        q.get()


def measure(G: int, repeats: int) -> tuple[float, float]:
    """Best seconds per trajectory for the protocol and for the queue at G groups in flight."""
    assert G % (ETA + 1) == 0
    m = StalenessManager(staleness=ETA, batch_size=G // (ETA + 1), group_size=N)
    order = [g for g in range(G) for _ in range(N)]
    random.Random(0).shuffle(order)
    items = list(range(G * N))
    best_s = best_q = float("inf")
    rounds = max(1, 4096 // G)  # about the same number of trajectories per timing at both sizes
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(rounds):
            staleness_round(m, G, order)
        t1 = time.perf_counter()
        for _ in range(rounds):
            queue_round(items)
        t2 = time.perf_counter()
        best_s = min(best_s, (t1 - t0) / (rounds * G * N))
        best_q = min(best_q, (t2 - t1) / (rounds * G * N))
    assert m.stats.refusals == 0 and m.stats.passive_aborts == 0
    return best_s, best_q


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    results = {}
    sizes = {"64x8": 64, "4096x8": 4096}
    for name, G in sizes.items():
        s, q = measure(G, args.repeats)
        results[name] = (s, q)
        print(
            f"{name:>7} ({G} groups in flight): protocol {s * 1e6:6.3f} us/traj   queue.Queue {q * 1e6:6.3f} us/traj   "
            f"ratio to queue {s / q:5.2f}x"
        )
    small, large = results["64x8"][0], results["4096x8"][0]
    print(f"scaling: cost at 4096x8 / cost at 64x8 = {large / small:.2f}x")
    print(
        json.dumps(
            {
                "ratio_to_queue": {k: round(s / q, 3) for k, (s, q) in results.items()},
                "scaling_4096_over_64": round(large / small, 3),
            }
        )
    )


if __name__ == "__main__":
    main()
