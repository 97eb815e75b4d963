"""Local trainer ranks live and die with the driver, and their silence is told from a long command (issue #33,
item 6): the kernel kills the ranks when the driver dies (``PR_SET_PDEATHSIG``, from a thread that outlives the
one that asked for the ranks), a rank stopped with SIGSTOP is named alone while its peer waits behind it, and a
command longer than several heartbeats is not silence; ``trainer.rank_timeout_s`` bounds the command."""

from __future__ import annotations

import dataclasses
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from psrl.train.launch import SILENT_BEATS, LocalRanks, RankFailure
from psrl.train.planner import plan
from psrl.train.worker import StepInput
from tests.runtime.test_train_cli_e2e import TINY
from tests.train.test_train_worker import WAIT_S, _batch, _gone, _spec, build_tiny_gpt2

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)]), "OMP_NUM_THREADS": "1"}
GONE_WITHIN_S = 5.0
FORWARD_S = 2.0
"""How long a forward of :func:`build_slow` takes: several heartbeats of the slow test."""


def _logprobs_input() -> StepInput:
    prompts, responses, _, _, _ = _batch(0)
    return StepInput(plan([len(a) + len(b) for a, b in zip(prompts, responses)], 2, 1, None), prompts, responses)


def _all_gone(pids: list[int], within_s: float) -> bool:
    """Whether every process of ``pids`` is gone (or a zombie) within ``within_s``: bounded polling of /proc."""
    deadline = time.monotonic() + within_s
    while not all(_gone(p) for p in pids):
        if time.monotonic() > deadline:
            return False
        threading.Event().wait(0.05)  # polling /proc for the exits (an event), bounded by the deadline
    return True


def _kill_all(pids: list[int]) -> None:
    """Leave nothing behind when a test fails (SIGKILL ends a stopped process too)."""
    for p in pids:
        if not _gone(p):
            os.kill(p, signal.SIGKILL)


@pytest.mark.slow
def test_a_rank_stopped_with_sigstop_is_named_alone(tmp_path):
    """Ranks asked for from a thread that has ended still run (their parent-death signal follows the launcher's
    own thread, not the caller's). Then rank 1 is stopped: rank 0 waits for it in the first collective, beating;
    the driver reports rank 1 as silent within a few heartbeats, says rank 0 was alive, and no rank is left."""
    spec = dataclasses.replace(_spec("token-mean"), heartbeat_s=0.5)
    got: list[LocalRanks] = []
    caller = threading.Thread(target=lambda: got.append(LocalRanks(spec, 2, WAIT_S, tmp_path)))
    caller.start()
    caller.join()
    ranks = got[0]
    pids = [p for p in ranks.pids if p is not None]
    try:
        assert len(ranks.call("digest")) == 2  # alive after the thread that started LocalRanks ended
        os.kill(pids[1], signal.SIGSTOP)
        started = time.monotonic()
        with pytest.raises(RankFailure) as err:
            ranks.call("logprobs", _logprobs_input())
        took = time.monotonic() - started
        first = str(err.value).splitlines()[0]
        print(f"reported after {took:.1f} s: {first}")
        assert err.value.rank == 1
        assert first.startswith("trainer rank 1 went silent during 'logprobs'"), first
        assert first.endswith("; alive and waiting: 0; its log ends:"), first  # rank 0 is not called silent
        assert _all_gone(pids, GONE_WITHIN_S)
    finally:
        _kill_all(pids)


def build_slow(device: str) -> torch.nn.Module:
    """The tiny GPT-2 whose every forward takes :data:`FORWARD_S` (a long command: many heartbeats long)."""
    model = build_tiny_gpt2(device)
    model.register_forward_pre_hook(_take_long)
    return model


def _take_long(module: torch.nn.Module, args: tuple) -> None:
    threading.Event().wait(FORWARD_S)


@pytest.mark.slow
def test_a_long_command_is_not_silence_and_rank_timeout_s_bounds_it(tmp_path):
    """A command four heartbeats long (both ranks busy, their side threads beating) finishes; the same command
    under a shorter ``reply_timeout_s`` (``trainer.rank_timeout_s``) is reported as not finished in time, naming
    the ranks still working -- not as silent."""
    spec = dataclasses.replace(_spec("token-mean"), build=build_slow, heartbeat_s=FORWARD_S / (SILENT_BEATS + 1))
    ranks = LocalRanks(spec, 2, WAIT_S, tmp_path)
    pids = [p for p in ranks.pids if p is not None]
    try:
        assert len(ranks.call("logprobs", _logprobs_input())) == 2
        ranks.reply_timeout_s = FORWARD_S / 4  # a bound shorter than one forward (a test's setting)
        with pytest.raises(RankFailure, match=r"did not finish 'logprobs' within 0\.5 s \(trainer\.rank_timeout_s"):
            ranks.call("logprobs", _logprobs_input())
        assert _all_gone(pids, GONE_WITHIN_S)
    finally:
        _kill_all(pids)


def _ranks_of(driver: int) -> list[int]:
    """The spawned children of ``driver`` (its rank processes), from /proc."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (entry / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == driver and b"spawn_main" in cmdline:
            out.append(int(entry.name))
    return out


@pytest.mark.slow
def test_kill_9_of_psrl_train_at_two_ranks_leaves_no_rank_within_5_s(tmp_path):
    """``psrl train`` at 2 ranks, killed with SIGKILL once a step is done: no rank process within 5 s."""
    run_dir = tmp_path / "run"
    args = TINY + [f"trainer.run_dir={run_dir}", "psrl.deployment.train_ngpus_per_node=2", "trainer.total_steps=1000"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "psrl.cli", "train", *args], env=ENV, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    pids: list[int] = []
    try:
        deadline = time.monotonic() + WAIT_S * 2
        metrics = run_dir / "metrics.jsonl"
        while not (metrics.exists() and metrics.read_text().strip()):  # the ranks have trained a step
            assert proc.poll() is None, f"psrl train exited with {proc.returncode}"
            assert time.monotonic() < deadline, "no step within the deadline"
            threading.Event().wait(0.2)  # polling for the first row (an event), bounded by the deadline
        pids = _ranks_of(proc.pid)
        assert len(pids) == 2, pids
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        assert _all_gone(pids, GONE_WITHIN_S), f"rank processes {pids} outlived psrl train by {GONE_WITHIN_S} s"
    finally:
        _kill_all(pids)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


STARTING = """
import json, multiprocessing, sys, threading
from psrl.train.launch import LocalRanks
from tests.train.test_train_worker import _spec
threading.Thread(target=LocalRanks, args=(_spec("token-mean"), 2, 120.0, sys.argv[1]), daemon=True).start()
while len(multiprocessing.active_children()) < 2:
    threading.Event().wait(0.01)
print(json.dumps([p.pid for p in multiprocessing.active_children()]), flush=True)
sys.stdin.read()  # until killed
"""


@pytest.mark.slow
def test_a_driver_killed_while_its_ranks_start_leaves_none_within_5_s(tmp_path):
    """The driver is killed the moment its ranks exist, while they still import torch: each knows its driver's
    pid from the start (no parent recorded too late) and exits; none is left within 5 s."""
    proc = subprocess.Popen(
        [sys.executable, "-c", STARTING, str(tmp_path)], env=ENV, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        start_new_session=True,
    )  # fmt: skip
    pids: list[int] = []
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], WAIT_S)
        assert ready, "the driver did not start its ranks in time"
        pids = json.loads(proc.stdout.readline())
        assert len(pids) == 2 and not any(_gone(p) for p in pids)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        assert _all_gone(pids, GONE_WITHIN_S), f"rank processes {pids} outlived the driver by {GONE_WITHIN_S} s"
    finally:
        _kill_all(pids)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
