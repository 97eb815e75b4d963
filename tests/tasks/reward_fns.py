"""Reward functions in verl's ``compute_score`` shape, for the dataset-task tests (imported by name)."""

import asyncio

CALLS: list[tuple] = []


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """verl's signature; returns a dict with score and acc (counts its calls)."""
    CALLS.append((data_source, solution_str, ground_truth, extra_info))
    ok = float(solution_str.strip() == str(ground_truth))
    return {"score": ok, "acc": ok, "length": float(len(solution_str))}


async def async_score(data_source, solution_str, ground_truth, extra_info=None):
    """An async reward returning a plain float."""
    await asyncio.sleep(0)
    return 0.5


def raising_score(data_source, solution_str, ground_truth, extra_info=None):
    raise ValueError("grader exploded")


async def never_returns(data_source, solution_str, ground_truth, extra_info=None):
    await asyncio.Event().wait()


def no_score(data_source, solution_str, ground_truth, extra_info=None):
    return {"acc": 1.0}


def explodes_on_marked_rows(data_source, solution_str, ground_truth, extra_info=None):
    """Raises on rows whose extra_info says so; 0.0 elsewhere."""
    if (extra_info or {}).get("explode"):
        raise ValueError("grader exploded")
    return 0.0


def length_parity(data_source, solution_str, ground_truth, extra_info=None):
    """1 for an odd-length answer: sampled answers of one prompt differ, so groups have a nonzero spread."""
    return float(len(solution_str) % 2)


RELEASE = __import__("threading").Event()
"""Set by a test when it is done, so the threads held by :func:`hangs_on_marked_rows` end."""


def hangs_on_marked_rows(data_source, solution_str, ground_truth, extra_info=None):
    """A synchronous reward that does not return on rows whose extra_info says so (until RELEASE); 0.0 elsewhere."""
    if (extra_info or {}).get("hang"):
        RELEASE.wait()
    return 0.0
