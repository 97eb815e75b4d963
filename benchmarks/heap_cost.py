"""What the heap setting (``src/psrl/heap.py``) costs and saves, measured side by side (issue #33, item 6).

Each run is a whole ``psrl train`` process under one of three heap settings:

* ``none``: glibc's defaults (no ``mallopt``, no trim);
* ``threshold``: the earlier setting -- a fixed 1 MiB mmap threshold and 2 arenas (every tensor of 1 MiB or more an
  ``mmap`` / ``munmap`` pair);
* ``psrl``: psrl's setting now (``src/psrl/heap.py``) -- an 8 MiB mmap threshold (trim threshold 16 MiB), 2 arenas,
  ``malloc_trim(0)`` after every training step.

Two jobs: ``default`` (the built-in job, synchronous: ``psrl train psrl.staleness=0 trainer.total_steps=N``; wall,
user and system seconds; ``--runs`` runs of each setting, interleaved ``none, threshold, psrl, none, ...`` so that
a drift of the shared machine's speed falls on all three) and ``smollm2`` (SmolLM2-135M-Instruct on
``examples/arith2``, the workload of docs/learning.md, ``psrl.staleness=2``: the run whose heap grew past 20 GB
without a setting; its peak resident memory ``VmHWM``, ``--smollm2-runs`` runs of each setting, interleaved, each
~8 GB: one at a time). Seconds and peaks are the finished process's own accounting (``wait4``); each ratio is taken
run by run against ``none`` (the default job's wall) or ``threshold`` (SmolLM2's peak), then its median. A SmolLM2
run also stores its peak RSS per phase (``phase_peak_bytes``: sampled every 10 ms while an hf decode step, the
log-prob forwards, the training step or a version's hand-over ran, or several at once), which says where it peaks.

    PYTHONPATH=src python benchmarks/heap_cost.py [--jobs default smollm2] [--runs 3] [--steps 25]
        [--smollm2-steps 10] [--smollm2-runs 2] [--results docs/results/heap_cost.json]

The last line is one JSON object: ``default_wall_psrl_over_none`` (acceptance: <= 1.03; beside it
``default_cpu_psrl_over_none``, user + system seconds, which the machine's load moves less),
``default_wall_threshold_over_none`` and ``smollm2_peak_psrl_over_threshold`` (acceptance: <= 1).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))
import results as stored  # noqa: E402

SETTINGS = ("none", "threshold", "psrl")


def _apply(setting: str) -> None:
    """In a child ``psrl train``: replace psrl's heap setting by ``setting`` before the run imports it."""
    import ctypes
    import ctypes.util

    import psrl.heap as heap

    if setting not in SETTINGS:
        raise ValueError(f"unknown heap setting {setting!r}, use one of {SETTINGS}")
    if setting == "none":
        heap.return_freed_memory = lambda arenas=2, mmap_threshold=0: False
        heap.release_freed = lambda: False
    elif setting == "threshold":  # what psrl/heap.py set before issue #33 (M_MMAP_THRESHOLD -3, M_ARENA_MAX -8)
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        heap.return_freed_memory = lambda arenas=2, mmap_threshold=0: (
            bool(libc.mallopt(-3, 1 << 20)) and bool(libc.mallopt(-8, arenas))
        )
        heap.release_freed = lambda: False


PHASES = {
    "gen": ("psrl.rollout.engines.hf", "HFEngine", "step"),
    "logprobs": ("psrl.train.worker", "RankWorker", "logprobs"),
    "train": ("psrl.train.worker", "RankWorker", "train_step"),
    "publish": ("psrl.train.worker", "RankWorker", "export"),
}
"""What the child's peak is attributed to: an hf engine's decode step, the pre-update log-prob forwards, the
training step (forward, backward, optimiser), the hand-over of a version (world size 1, hf engines)."""


def phase_peaks(out: Path) -> None:
    """Sample this process's RSS every 10 ms; at exit write the highest seen while each set of :data:`PHASES` was
    running (``gen+train``: both at once; ``other``: none) to ``out`` (JSON, bytes)."""
    import atexit
    import functools
    import importlib
    import threading

    active: dict[str, int] = dict.fromkeys(PHASES, 0)
    peaks: dict[str, int] = {}

    def wrap(name: str, fn):
        @functools.wraps(fn)
        def inner(*a, **k):
            active[name] += 1
            try:
                return fn(*a, **k)
            finally:
                active[name] -= 1

        return inner

    for name, (module, cls, attr) in PHASES.items():
        owner = getattr(importlib.import_module(module), cls)
        setattr(owner, attr, wrap(name, getattr(owner, attr)))

    def sample() -> None:
        while True:
            with open("/proc/self/status") as f:
                rss = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))
            key = "+".join(n for n, c in active.items() if c > 0) or "other"
            peaks[key] = max(peaks.get(key, 0), rss)
            time.sleep(0.01)

    threading.Thread(target=sample, daemon=True).start()
    atexit.register(lambda: out.write_text(json.dumps(peaks)))


def child(setting: str, args: list[str]) -> int:
    _apply(setting)
    if os.environ.get("PSRL_HEAP_TRIMS"):  # how often psrl's watcher trimmed (psrl.heap.FreedPages)
        import atexit

        import psrl.heap as heap

        out = Path(os.environ["PSRL_HEAP_TRIMS"])
        atexit.register(lambda: out.write_text(str(heap.watcher.trims if heap.watcher is not None else 0)))
    if os.environ.get("PSRL_HEAP_PHASES"):
        phase_peaks(Path(os.environ["PSRL_HEAP_PHASES"]))
    from psrl.train_cli import main

    return main(args)


def run(setting: str, args: list[str], phases: Path | None = None) -> dict:
    """One ``psrl train ARGS`` under ``setting``: its wall, user and system seconds and peak RSS (bytes); with
    ``phases`` (a file for the child) also its peak RSS per phase (``phase_peak_bytes``, :func:`phase_peaks`)."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", setting, "--", *args]
    trims = Path(tempfile.mkstemp(prefix="psrl-heap-trims-")[1])
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "HF_HUB_OFFLINE": "1", "PSRL_HEAP_TRIMS": str(trims)}
    if phases is not None:
        env["PSRL_HEAP_PHASES"] = str(phases)
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    assert proc.stderr is not None
    err = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        sys.exit(f"psrl train failed ({proc.returncode}) under {setting}: {' '.join(args)}\n{err.decode()[-3000:]}")
    out: dict = {"wall_s": wall, "user_s": usage.ru_utime, "sys_s": usage.ru_stime}
    out["cpu_s"] = usage.ru_utime + usage.ru_stime
    out["peak_rss_bytes"] = usage.ru_maxrss * 1024
    out["trims"] = int(trims.read_text() or 0)
    trims.unlink()
    print(f"{setting:9s} {json.dumps({k: round(v, 2) for k, v in out.items()})}", file=sys.stderr, flush=True)
    if phases is not None and phases.exists():
        out["phase_peak_bytes"] = json.loads(phases.read_text())
        print(f"{'':9s} peak by phase (GiB): {_gib(out['phase_peak_bytes'])}", file=sys.stderr, flush=True)
    return out


def _gib(peaks: dict[str, int]) -> str:
    return ", ".join(f"{k} {v / 2**30:.2f}" for k, v in sorted(peaks.items(), key=lambda kv: -kv[1]))


def smollm2_args(root: Path, steps: int) -> list[str]:
    """The SmolLM2 ``arith2`` workload of benchmarks/learning.py, ``steps`` steps at ``psrl.staleness=2``."""
    from learning import smollm2_overrides

    return [*smollm2_overrides(root), "psrl.staleness=2", f"trainer.total_steps={steps}"]


def measure(
    job: str, args: list[str], runs: int, root: Path, settings: list[str], phases: bool = False
) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {s: [] for s in settings}
    for r in range(runs):
        for s in settings:
            where = root / f"{job}-{s}-{r}"
            out[s].append(run(s, [*args, f"trainer.run_dir={where}"], where.with_suffix(".phases") if phases else None))
    return out


def paired(runs: dict[str, list[dict[str, float]]], a: str, b: str, key: str) -> float:
    return statistics.median(x[key] / y[key] for x, y in zip(runs[a], runs[b]))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        return child(argv[1], argv[3:])
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--jobs", nargs="+", default=["default", "smollm2"], choices=("default", "smollm2"))
    p.add_argument("--runs", type=int, default=3, help="runs of each setting of the default job")
    p.add_argument("--steps", type=int, default=25, help="the default job's synchronous steps")
    p.add_argument("--smollm2-steps", type=int, default=10)
    p.add_argument("--smollm2-runs", type=int, default=2, help="runs of each setting of the smollm2 job (~8 GB each)")
    p.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=SETTINGS, help="of the default job")
    p.add_argument("--smollm2-settings", nargs="+", default=list(SETTINGS), choices=SETTINGS)
    p.add_argument("--results", type=Path, default=None)
    ns = p.parse_args(argv)
    summary: dict[str, float] = {}
    measured: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="psrl-heap-") as tmp:
        root = Path(tmp)
        if "default" in ns.jobs:
            args = ["psrl.staleness=0", f"trainer.total_steps={ns.steps}"]
            runs = measure("default", args, ns.runs, root, ns.settings)
            measured["default"] = runs
            for s in ("psrl", "threshold"):
                if s in runs and "none" in runs:
                    summary[f"default_wall_{s}_over_none"] = paired(runs, s, "none", "wall_s")
                    summary[f"default_cpu_{s}_over_none"] = paired(runs, s, "none", "cpu_s")
            for s in ns.settings:
                for key in ("wall_s", "sys_s", "peak_rss_bytes"):
                    summary[f"default_{key}_{s}"] = statistics.median(x[key] for x in runs[s])
        if "smollm2" in ns.jobs:
            args = smollm2_args(root, ns.smollm2_steps)
            runs = measure("smollm2", args, ns.smollm2_runs, root, ns.smollm2_settings, phases=True)
            measured["smollm2"] = runs
            if "psrl" in runs and "threshold" in runs:
                summary["smollm2_peak_psrl_over_threshold"] = paired(runs, "psrl", "threshold", "peak_rss_bytes")
            for s in ns.smollm2_settings:
                for key in ("wall_s", "sys_s", "peak_rss_bytes"):
                    summary[f"smollm2_{key}_{s}"] = statistics.median(x[key] for x in runs[s])
    for name, value in summary.items():
        shown = f"{value / 2**30:.2f} GiB" if name.endswith("bytes") or "_peak_rss_" in name else f"{value:.3f}"
        print(f"{name:40s} {shown}")
    if ns.results is not None:
        args = {"jobs": ns.jobs, "runs": ns.runs, "steps": ns.steps}
        args |= {"smollm2_runs": ns.smollm2_runs, "smollm2_steps": ns.smollm2_steps}
        stored.write(ns.results, {"args": args, "summary": summary, "runs": measured})
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
