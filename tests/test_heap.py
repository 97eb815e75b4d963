"""psrl.heap: a CPU trainer's heap hands what a step freed back to the kernel (trim between steps), while a large
tensor freed and allocated again inside a step is reused from the heap, not mapped and faulted in afresh."""

import subprocess
import sys
import textwrap

import pytest

from psrl.heap import return_freed_memory, trim

FRAGMENTS = textwrap.dedent(
    """
    import sys
    from psrl.heap import return_freed_memory, trim
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
    if sys.argv[1] == "trim":
        assert trim()
    print(rss())
    """
)

REUSE = textwrap.dedent(
    """
    import resource
    from psrl.heap import return_freed_memory
    assert return_freed_memory()
    import torch
    torch.set_num_threads(1)
    torch.empty(1 << 16, dtype=torch.uint8).fill_(1)  # torch's own first-use allocations, out of the count
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(50):  # a step's activation: allocated, written, freed, again
        torch.empty(4 << 20, dtype=torch.uint8).fill_(1)
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    """
)


def _run(probe: str, *args: str) -> int:
    out = subprocess.run([sys.executable, "-c", probe, *args], capture_output=True, text=True, check=True)
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt and malloc_trim")
def test_trim_gives_the_freed_fragments_back_to_the_kernel():
    """After the same fragmenting allocations, the process holds less once trimmed (what the trainer does after
    each command)."""
    rss = {mode: _run(FRAGMENTS, mode) for mode in ("keep", "trim")}
    assert rss["trim"] + (50 << 20) < rss["keep"], rss  # ~100 MB of freed blocks held untrimmed (measured here)
    assert return_freed_memory() is True
    trim()  # in this process too: callable any time, from any thread


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_a_large_block_freed_and_allocated_again_is_not_faulted_in_again():
    """50 times a 4 MiB tensor (1,024 pages): mostly reused from the heap, its pages fault in a few times (3 to 9
    of the 50, measured here: glibc trims the heap's top now and then), not every time -- a fixed 1 MiB mmap
    threshold mapped and unmapped it each time: 51,200 faults, the sys time of issue #33."""
    pages = (4 << 20) // 4096
    faults = _run(REUSE)
    assert faults < 50 * pages // 4, faults
