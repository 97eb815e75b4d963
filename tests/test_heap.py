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
