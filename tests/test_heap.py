"""psrl.heap: glibc's malloc told to return freed memory between steps (what keeps a CPU trainer's RSS flat)."""

import subprocess
import sys
import textwrap

import pytest

from psrl.heap import release_freed, return_freed_memory

PROBE = textwrap.dedent(
    """
    import sys
    from psrl.heap import release_freed, return_freed_memory
    if sys.argv[1] == "on":
        assert return_freed_memory()
    import torch
    torch.set_num_threads(1)
    def rss():  # anonymous pages only: file-backed ones (torch's libraries) come and go with the machine's load
        line = next(ln for ln in open("/proc/self/status") if ln.startswith("RssAnon:"))
        return int(line.split()[1]) * 1024
    torch.empty(4 << 20, dtype=torch.uint8).fill_(1)  # freed: glibc's dynamic threshold rises to 4 MiB
    small = []
    for i in range(100):  # growing blocks, each freed under a small one kept: what a trainer's steps leave
        big = torch.empty((1 << 20) + i * 20000, dtype=torch.uint8).fill_(1)
        small.append(torch.empty(1 << 14, dtype=torch.uint8).fill_(1))
        del big
    if sys.argv[1] == "on":
        assert release_freed()  # what a rank does after each step
    print(rss())
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_freed_blocks_go_back_to_the_kernel_with_it_and_stay_in_the_heap_without():
    """After the same allocation pattern and freeing everything, the process holds less once it released what it
    freed (``malloc_trim``: the free pages between the small blocks kept, not only the heap's top)."""
    rss = {}
    for mode in ("off", "on"):
        out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True)
        rss[mode] = int(out.stdout.split()[-1])
    assert rss["on"] + (50 << 20) < rss["off"], rss  # ~100 MB of freed blocks held without it (measured here)
    assert return_freed_memory() is True and isinstance(release_freed(), bool)


WATCHED = textwrap.dedent(
    """
    import json
    import torch
    from psrl import heap
    torch.set_num_threads(1)
    heap._libc().mallopt(-3, 8 << 20)  # blocks under 8 MiB from the heap (psrl's threshold), no watcher thread
    pages = heap.FreedPages(limit=32 << 20, every_s=None)
    out = {}
    for i in range(20):  # churn under the limit: the same 1 MiB block freed and taken again
        torch.empty(1 << 20, dtype=torch.uint8).fill_(1)
    out["small_churn_trimmed"] = pages.check()
    small = []
    for i in range(100):  # growing blocks, each freed under a small one kept: ~150 MB of freed pages held
        big = torch.empty((1 << 20) + i * 20000, dtype=torch.uint8).fill_(1)
        small.append(torch.empty(1 << 14, dtype=torch.uint8).fill_(1))
        del big
    out["held_before"] = heap.held_free()
    out["trimmed"] = pages.check()
    out["held_after"] = heap.held_free()
    out["trimmed_again"] = pages.check()
    for i in range(60):  # the pattern again, smaller: freed pages held again, but under the earlier high
        big = torch.empty((1 << 20) + i * 20000, dtype=torch.uint8).fill_(1)
        small.append(torch.empty(1 << 14, dtype=torch.uint8).fill_(1))
        del big
    out["held_below_high"] = heap.held_free() - pages.floor
    out["trimmed_below_high"] = pages.check()
    out["trims"] = pages.trims
    print(json.dumps(out))
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallinfo2 and malloc_trim")
def test_the_watcher_trims_once_the_freed_pages_held_pass_its_limit_and_not_before():
    """``FreedPages.check`` leaves a heap whose churn stays under its limit alone, gives the kernel back what a
    fragmenting pattern freed once it passes the limit at a new high of resident memory, does not trim again with
    nothing new freed, and keeps what the pattern freed again below that high (no trim: what keeps the built-in
    job's steps off the kernel)."""
    import json

    out = subprocess.run([sys.executable, "-c", WATCHED], capture_output=True, text=True, check=True)
    got = json.loads(out.stdout.split("\n")[-2])
    assert got["small_churn_trimmed"] is False, got
    assert got["trimmed"] is True and got["held_before"] - got["held_after"] > (64 << 20), got
    assert got["trimmed_again"] is False, got
    assert got["held_below_high"] > (32 << 20) and got["trimmed_below_high"] is False, got  # under the peak: kept
    assert got["trims"] == 1, got


def test_return_freed_memory_starts_one_watcher_per_process():
    """``return_freed_memory`` (called by ``psrl train`` and by every rank at start) starts the process's watcher
    once, however often it is called."""
    from psrl import heap

    if heap._libc() is None:
        pytest.skip("glibc only")
    return_freed_memory()
    first = heap.watcher
    return_freed_memory()
    assert first is not None and heap.watcher is first
