"""The trainer rank worker and its local launcher (issue #22, item 1): 2 spawned gloo ranks answer ``logprobs`` and
``train_step`` as one in-process worker does (same batch, same weights after the steps), and a rank that dies
mid-step is a clear error naming it -- never a hang, never a rank left running."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import functools
import json
import multiprocessing
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

from psrl.algo.losses import AGG_MODES
from psrl.config import AlgorithmConfig, RolloutCorrectionConfig
from psrl.train.launch import InProcess, LocalRanks, RankFailure
from psrl.train.planner import plan
from psrl.train.worker import StepInput, WorkerSpec, step_input

LENGTHS = [3, 30, 5, 2, 17, 4]  # response lengths, skewed
STEPS = 2
WAIT_S = 120.0  # bounded replies: far above a step here, far below a CI timeout


def build_tiny_gpt2(device: str) -> torch.nn.Module:
    """The built-in model's architecture at a tiny shape, from a fixed seed (``meta``: shapes only)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        vocab_size=40, n_positions=64, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
    )
    cfg.bos_token_id = cfg.eos_token_id = cfg.pad_token_id = 0
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        with torch.device(device):
            return GPT2LMHeadModel(cfg)


def _spec(mode: str) -> WorkerSpec:
    rc = RolloutCorrectionConfig(is_="token", is_threshold=2.0, rs="token", rs_threshold=1.5)
    algo = AlgorithmConfig(loss_agg_mode=mode, rollout_correction=rc)
    return WorkerSpec(build=build_tiny_gpt2, pad_id=0, algo=algo, lr=1e-3, grad_clip=0.5, temperature=0.9)


def _batch(step: int):
    g = torch.Generator().manual_seed(100 + step)
    prompts = [
        torch.randint(1, 40, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g).tolist() for _ in LENGTHS
    ]
    responses = [torch.randint(1, 40, (n,), generator=g).tolist() for n in LENGTHS]
    masks = [(torch.rand(n, generator=g) > 0.2).float().tolist() for n in LENGTHS]
    adv = torch.randn(len(LENGTHS), generator=g).tolist()
    noise = [(torch.randn(n, generator=g) * 0.3).tolist() for n in LENGTHS]
    return prompts, responses, masks, adv, noise


def _step(ranks, mode: str, world: int, step: int, budget: int | None) -> tuple[dict, dict]:
    """One step of the driver's protocol on batch ``step`` (2 minibatches, token budget ``budget``); returns the
    pre-update log-probs and the step's metrics."""
    prompts, responses, masks, adv, noise = _batch(step)
    p = plan([len(a) + len(b) for a, b in zip(prompts, responses)], world, 2, budget)
    old: dict[int, list[float]] = {}
    for part in ranks.call("logprobs", StepInput(p, prompts, responses)):
        old.update(part)
    behav = [[o + e for o, e in zip(old[i], noise[i])] for i in range(len(LENGTHS))]
    inp = step_input(p, prompts, responses, old, behav, adv, masks, _spec(mode).algo)
    return old, ranks.call("train_step", inp)[0]


def _state(ranks) -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(v) for k, v in ranks.call("state")[0].items()}


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def _run(ranks, mode: str, world: int, budgets: tuple) -> tuple[list, list, dict[str, torch.Tensor]]:
    """STEPS steps (token budget ``budgets[step]``); returns (old log-probs per step, metrics per step, final
    state). At 2 ranks, step 0 has zero-weight padding micro-batches and step 1 a 2-row micro-batch beside a 1-row
    one (the shape that hung when a micro-batch was a forward per row)."""
    olds, metrics = [], []
    for step in range(STEPS):
        if world > 1:
            prompts, responses, *_ = _batch(step)
            p = plan([len(a) + len(b) for a, b in zip(prompts, responses)], world, 2, budgets[step])
            mbs = [m for per_rank in p.minibatches[0] for m in per_rank]
            assert any(m.padding for m in mbs) if step == 0 else any(len(m.rows) > 1 for m in mbs)
        old, m = _step(ranks, mode, world, step, budgets[step])
        olds.append(old)
        metrics.append(m)
    return olds, metrics, _state(ranks)


def test_two_ranks_train_step_equals_one_in_process_worker(two_ranks, tmp_path):
    """Same batch, planned over 2 ranks (token budgets 8 then 16: padding micro-batches, then a 2-row one beside a
    1-row one) and over 1:
    the pre-update log-probs, the loss and grad norm, and the weights after 2 steps of 2 minibatches agree."""
    torch.set_num_threads(1)
    InProcess(_spec("token-mean")).call("save", str(tmp_path / "start"))
    two_ranks.call("load", str(tmp_path / "start"))  # the session's ranks, back to the starting weights, AdamW fresh
    olds1, m1, s1 = _run(InProcess(_spec("token-mean")), "token-mean", 1, (None, None))
    olds2, m2, s2 = _run(two_ranks, "token-mean", 2, (8, 16))
    for a, b in zip(olds1, olds2):
        assert a.keys() == b.keys()
        assert max(abs(x - y) for i in a for x, y in zip(a[i], b[i])) <= 1e-5
    for a, b in zip(m1, m2):
        assert a["train/loss"] == pytest.approx(b["train/loss"], rel=1e-4, abs=1e-7)
        assert a["train/grad_norm"] == pytest.approx(b["train/grad_norm"], rel=1e-4)
    diff = _max_diff(s1, s2)
    print(f"max |param difference| 1 vs 2 ranks = {diff:.2e}")
    assert diff <= 1e-5
    usage = two_ranks.call("usage")  # each rank holds its shards: together, one model and its AdamW moments
    whole = sum(p.numel() * 4 for p in build_tiny_gpt2("cpu").parameters())
    assert sum(u["param_bytes"] for u in usage) == whole and sum(u["optim_bytes"] for u in usage) >= 2 * whole
    d1 = asyncio.run(two_ranks.acall("digest"))  # what the coordinator's loop would await
    assert d1[0] == d1[1]  # every rank gathers the same state


@pytest.mark.slow
def test_a_rank_killed_mid_step_is_a_clear_error_not_a_hang(tmp_path):
    """SIGKILL rank 1, then ask for a step: rank 0 is left in a collective with a dead peer; the driver names
    rank 1 and its exit code, and no rank process is left."""
    ranks = LocalRanks(_spec("token-mean"), 2, reply_timeout_s=WAIT_S, log_dir=tmp_path)
    prompts, responses, _, _, _ = _batch(0)
    p = plan([len(a) + len(b) for a, b in zip(prompts, responses)], 2, 1, None)
    pid = ranks.pids[1]
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(RankFailure, match=r"trainer rank 1 died \(exit code -9\)") as err:
        ranks.call("logprobs", StepInput(p, prompts, responses))
    assert err.value.rank == 1
    assert not any(proc.is_alive() for proc in ranks.procs)


def _copy_of(model: torch.nn.Module, device: str) -> torch.nn.Module:
    return copy.deepcopy(model).to(device)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_in_process_worker_step_equals_the_trainer_step(mode):
    """World size 1 runs the rank worker (issue #33): its logprobs + train_step over the planner (2 minibatches, token
    budget 12, IS and RS on) give the weights, loss and grad norm of the one-process reference trainer (the path psrl
    had before, kept in tests) on the same batch."""
    from psrl.algo.advantages import ADV_ESTIMATORS
    from psrl.config import ModelConfig, TaskConfig, TrainerConfig
    from psrl.models import build_policy
    from psrl.rollout.fakes import random_batch
    from psrl.tasks import get_task
    from tests.train.reference_trainer import ReferenceTrainer

    task = get_task(TaskConfig(name="arith"), seed=0)
    policy = build_policy(ModelConfig(n_layer=1, n_embd=32, n_head=2, device="cpu"), task, seed=0)
    batch = random_batch(task, lengths=(1, 9))
    algo = _spec(mode).algo
    tcfg = TrainerConfig(minibatches=2, lr=1e-3, grad_clip=0.5)
    spec = WorkerSpec(
        build=functools.partial(_copy_of, policy.model), pad_id=policy.pad_id, algo=algo, lr=tcfg.lr,
        weight_decay=tcfg.weight_decay, grad_clip=tcfg.grad_clip, temperature=tcfg.temperature,
    )  # fmt: skip
    ranks = InProcess(spec)
    trajs = [t for g in batch.groups for t in g]
    advs = ADV_ESTIMATORS[algo.adv_estimator]([[t.reward for t in g] for g in batch.groups], norm_by_std=True)
    prompts, responses = [t.prompt_ids for t in trajs], [t.response_ids for t in trajs]
    p = plan([len(a) + len(b) for a, b in zip(prompts, responses)], 1, tcfg.minibatches, 12)
    old = ranks.call("logprobs", StepInput(p, prompts, responses))[0]
    masks = [[float(v) for v in t.loss_mask] for t in trajs]
    adv = [a for g in advs for a in g]
    inp = step_input(p, prompts, responses, old, [t.logprobs for t in trajs], adv, masks, algo)
    got = ranks.call("train_step", inp)[0]
    want = ReferenceTrainer(policy, algo, tcfg).step(batch)
    assert got["train/loss"] == pytest.approx(want["train/loss"], rel=1e-5, abs=1e-7)
    assert got["train/grad_norm"] == pytest.approx(want["train/grad_norm"], rel=1e-5)
    mine = ranks.worker.model.state_dict()
    diff = max(float((mine[k] - v).abs().max()) for k, v in policy.model.state_dict().items())
    assert diff <= 1e-6


def build_or_stall(device: str) -> torch.nn.Module:
    """Rank 0 builds the model; the others (``meta``) never answer: a rank that stops responding."""
    if device == "meta":
        threading.Event().wait()
    return build_tiny_gpt2(device)


@pytest.mark.slow
def test_a_stuck_rank_is_a_timeout_naming_it_not_a_hang(tmp_path):
    """A rank stuck before its first reply: the driver gives up after ``reply_timeout_s``, names the ranks still
    working (rank 0 waits in the broadcast for rank 1, so both are) and kills them."""
    spec = dataclasses.replace(_spec("token-mean"), build=build_or_stall)
    before = set(multiprocessing.active_children())  # the module's 2-rank fixture may be running
    with pytest.raises(
        RankFailure, match=r"did not finish 'start' within 5 s \(trainer.rank_timeout_s; still working: 0, 1"
    ):
        LocalRanks(spec, 2, reply_timeout_s=5.0, log_dir=tmp_path)
    assert set(multiprocessing.active_children()) <= before


def test_a_checkpoint_resumes_at_another_world_size(two_ranks, tmp_path):
    """``save`` at 1 rank, ``load`` at 2 and continue == continuing at 1; ``save`` at 2, ``load`` at 1 and continue
    == continuing at 2 (DCP reshards model and AdamW state)."""
    torch.set_num_threads(1)
    _step(two_ranks, "token-mean", 2, 1, 16)  # the loading side has trained already: its AdamW state is replaced
    one = InProcess(_spec("token-mean"))
    _step(one, "token-mean", 1, 0, None)
    one.call("save", str(tmp_path / "at1"))
    _step(one, "token-mean", 1, 1, None)
    two_ranks.call("load", str(tmp_path / "at1"))
    _step(two_ranks, "token-mean", 2, 1, 16)
    one_to_two = _max_diff(_state(one), _state(two_ranks))
    two_ranks.call("save", str(tmp_path / "at2"))
    _step(two_ranks, "token-mean", 2, 0, 8)
    back = InProcess(_spec("token-mean"))
    back.call("load", str(tmp_path / "at2"))
    _step(back, "token-mean", 1, 0, None)
    two_to_one = _max_diff(_state(back), _state(two_ranks))
    print(f"resume 1 -> 2: {one_to_two:.2e}, 2 -> 1: {two_to_one:.2e}")
    assert one_to_two <= 1e-5 and two_to_one <= 1e-5


def test_publish_from_two_ranks_is_the_gathered_state_bit_for_bit(two_ranks, tmp_path):
    """``publish`` at 2 ranks in small buckets (issue #33, item 3): ``v{N}`` appears whole (no ``.tmp`` left), the
    buckets are spread over both ranks, every bucket's digest holds, the tensors equal the gathered state exactly,
    and the files and digest equal the in-process worker's publication of the same weights, byte for byte (the
    bf16 cast included); only the newest ``keep`` versions stay. The tied head is published once, at both sizes."""
    from psrl.weights import read_manifest, read_version, versions

    torch.set_num_threads(1)
    two_ranks.call("save", str(tmp_path / "ckpt"))
    one = InProcess(_spec("token-mean"))
    one.call("load", str(tmp_path / "ckpt"))
    bucket_mb = 0.01  # ~10 KB: the tiny model's tensors fall into several buckets
    for v in range(3):
        two_ranks.call("publish", (v, str(tmp_path / "w2"), 2, bucket_mb, torch.float32))
    one.call("publish", (2, str(tmp_path / "w1"), 2, bucket_mb, torch.float32))
    assert versions(tmp_path / "w2") == [1, 2] and not list((tmp_path / "w2").glob("*.tmp"))
    files = sorted(p.name for p in (tmp_path / "w2" / "v2").glob("*.safetensors"))
    assert len(files) >= 4
    version, published = read_version(tmp_path / "w2" / "v2")
    gathered = _state(two_ranks)
    assert version == 2 and published.keys() == gathered.keys()
    assert all(torch.equal(published[k], gathered[k]) for k in gathered)
    assert read_manifest(tmp_path / "w1" / "v2")["digest"] == read_manifest(tmp_path / "w2" / "v2")["digest"]
    tied = read_manifest(tmp_path / "w2" / "v2")  # FSDP2: both ranks find the tied head (its one local shard)
    assert tied["tied"] == {"lm_head.weight": "transformer.wte.weight"} == read_manifest(tmp_path / "w1" / "v2")["tied"]
    assert "lm_head.weight" not in [n for b in tied["buckets"] for n in b["names"]]
    assert published["lm_head.weight"] is published["transformer.wte.weight"]
    for f in files:
        assert (tmp_path / "w1" / "v2" / f).read_bytes() == (tmp_path / "w2" / "v2" / f).read_bytes()
    two_ranks.call("publish", (3, str(tmp_path / "b2"), 2, bucket_mb, torch.bfloat16))
    one.call("publish", (3, str(tmp_path / "b1"), 2, bucket_mb, torch.bfloat16))
    assert read_manifest(tmp_path / "b1" / "v3")["digest"] == read_manifest(tmp_path / "b2" / "v3")["digest"]
    assert read_manifest(tmp_path / "b2" / "v3")["dtypes"] == ["bfloat16"]


def build_tiny_llama_tied(device: str) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True, pad_token_id=0,
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        with torch.device(device):
            return LlamaForCausalLM(cfg)


def build_tiny_qwen2_untied(device: str) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False, pad_token_id=0,
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(2)
        with torch.device(device):
            return Qwen2ForCausalLM(cfg)


@pytest.mark.slow
@pytest.mark.parametrize("build", [build_tiny_llama_tied, build_tiny_qwen2_untied])
def test_llama_and_qwen2_shard_and_train_like_one_process(build, tmp_path):
    """Llama (tied embedding and head: one FSDP unit, the root) and Qwen2 (untied), tiny and random: rank 1 built on
    ``meta`` gets rank 0's weights by broadcast, and 2 ranks train as one in-process worker does."""
    torch.set_num_threads(1)
    spec = dataclasses.replace(_spec("seq-mean-token-mean"), build=build)
    one = InProcess(spec)
    _step(one, "seq-mean-token-mean", 1, 0, None)
    with LocalRanks(spec, 2, reply_timeout_s=WAIT_S, log_dir=tmp_path) as two:
        start = _state(two)
        _step(two, "seq-mean-token-mean", 2, 0, 8)
        got = _state(two)
    assert _max_diff(start, {k: v for k, v in build("cpu").state_dict().items()}) == 0.0
    diff = _max_diff(_state(one), got)
    print(f"{build.__name__}: max |param difference| 1 vs 2 ranks = {diff:.2e}")
    assert diff <= 1e-5


DRIVER = """
import json, sys
from psrl.train.launch import LocalRanks
from tests.train.test_train_worker import _spec
ranks = LocalRanks(_spec("token-mean"), 2, reply_timeout_s=120.0, log_dir=sys.argv[1])
print(json.dumps(ranks.pids), flush=True)
sys.stdin.read()  # until killed
"""


def _gone(pid: int) -> bool:
    """No such process, or a zombie (dead, waiting for whoever reaps orphans here)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (FileNotFoundError, ProcessLookupError):
        return True


@pytest.mark.slow
def test_sigkill_of_the_driver_leaves_no_rank(tmp_path):
    """SIGKILL of the driver alone (not its process group): its ranks notice they were orphaned and exit."""
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root / "src"), str(root)]), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-c", DRIVER, str(tmp_path)], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        start_new_session=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], WAIT_S)
        assert ready, "the driver did not start its ranks in time"
        pids = json.loads(proc.stdout.readline())
        assert len(pids) == 2 and not any(_gone(p) for p in pids)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        deadline = time.monotonic() + 30
        while not all(_gone(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)  # polling for the ranks' exit (an event), bounded by the deadline
        assert all(_gone(p) for p in pids), f"rank processes {pids} outlived the driver"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # whatever is left of the driver's session


def test_a_checkpoint_before_the_first_step_changes_nothing(tmp_path):
    """``save`` before any step keeps AdamW unstepped (DCP would initialise it with a zero step, shifting the next
    update's bias correction): the run that saved, and one loaded from it, step exactly as one that never saved."""
    torch.set_num_threads(1)
    plain, saver = InProcess(_spec("token-mean")), InProcess(_spec("token-mean"))
    saver.call("save", str(tmp_path / "c"))
    loaded = InProcess(_spec("token-mean"))
    loaded.call("load", str(tmp_path / "c"))
    for w in (plain, saver, loaded):
        _step(w, "token-mean", 1, 0, None)
    want = _state(plain)
    assert _max_diff(want, _state(saver)) == 0.0 and _max_diff(want, _state(loaded)) == 0.0


@pytest.mark.slow
def test_a_command_that_fails_on_a_rank_is_its_traceback_and_stops_every_rank(tmp_path):
    """A rank's exception comes back as the error, with its traceback; the other ranks may be mid-collective, so
    all are stopped. Both ranks fail here: whichever reply the driver reads first is named (a race, seen under
    load)."""
    ranks = LocalRanks(_spec("token-mean"), 2, reply_timeout_s=WAIT_S, log_dir=tmp_path)
    with pytest.raises(RankFailure, match=r"(?s)trainer rank [01] failed; its log ends:.*unknown trainer command 'x'"):
        ranks.call("x")
    assert not any(p.is_alive() for p in ranks.procs)
