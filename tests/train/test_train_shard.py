"""FSDP2 on 2 gloo ranks (CPU) with the planner's global loss weights equals one process: 3 AdamW steps, skewed
lengths, micro-batches under a token budget, clipping over the full norm, every loss_agg_mode.

Each micro-batch is ONE forward on every rank: under FSDP a forward is a round of all-gathers, so a rank that ran a
forward per trajectory of a 3-row micro-batch while the other ran one for its 1-row micro-batch deadlocked (one
rank in a backward reduce-scatter, the other in a forward all-gather) -- the hang this test was skipped for.
Measured on the 2-core box: max |parameter difference| 5.6e-7, 8.5e-7, 5.7e-6 over the three modes, 5-15 s each
(with the load of the shared box)."""

from __future__ import annotations

import faulthandler
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from psrl.algo.losses import AGG_MODES
from psrl.train.planner import loss_weights, plan
from psrl.train.shard import full_state, load_full_state, shard_model

LENGTHS = [3, 30, 5, 2, 17, 4]  # response lengths, skewed
PROMPT = 4
STEPS = 3
WAIT_S = 120  # per rank: longer than a run takes on a loaded 2-core box, short of a CI timeout


def _model(device: str = "cpu"):
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        vocab_size=64, n_positions=64, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
    )
    torch.manual_seed(0)
    with torch.device(device):
        return GPT2LMHeadModel(cfg)


def _batch(step: int):
    g = torch.Generator().manual_seed(100 + step)
    seqs = [torch.randint(0, 64, (PROMPT + n,), generator=g) for n in LENGTHS]
    masks = [(torch.rand(n, generator=g) > 0.25).float().tolist() for n in LENGTHS]
    adv = torch.randn(len(LENGTHS), generator=g).tolist()
    return seqs, masks, adv


def _micro_batch_logp(model, seqs: list[torch.Tensor]) -> torch.Tensor:
    """``[b, T]`` response log-probs of ``seqs`` in ONE right-padded forward: under FSDP every forward is a round of
    all-gathers, so a micro-batch must be one forward on every rank (a forward per row hangs when ranks hold
    different row counts: the bug this test was skipped for)."""
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    attn = torch.zeros(len(seqs), width, dtype=torch.long)
    for j, s in enumerate(seqs):
        ids[j, : len(s)], attn[j, : len(s)] = s, 1
    logits = model(input_ids=ids, attention_mask=attn).logits[:, PROMPT - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(2, ids[:, PROMPT:, None]).squeeze(2)


def _train(model, rank: int, world: int, mode: str, budget: int | None) -> list[tuple[float, float]]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    out = []
    for step in range(STEPS):
        seqs, masks, adv = _batch(step)
        p = plan([len(s) for s in seqs], world, 1, budget)
        w = loss_weights({i: masks[i] for i in range(len(seqs))}, mode)
        opt.zero_grad(set_to_none=True)
        total = torch.zeros(())
        for mb in p.minibatches[0][rank]:
            rows = mb.rows or (0,)  # padding: a zero-weight forward/backward, so every rank runs the same collectives
            logp = _micro_batch_logp(model, [seqs[i] for i in rows])
            scale = torch.zeros_like(logp)  # per-token -advantage * global weight, 0 on padding
            for j, i in enumerate(rows):
                scale[j, : len(w[i])] = -adv[i] * torch.tensor(w[i]) * (0.0 if mb.padding else 1.0)
            loss = (scale * logp).sum()
            (loss * world).backward()  # FSDP averages gradients over ranks; the weights already hold 1/N of the sum
            total = total + loss.detach()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        if world > 1:
            dist.all_reduce(total)
        opt.step()
        out.append((float(total), float(norm)))
    return out


def _rank(rank: int, world: int, port: int, mode: str, budget: int | None, q) -> None:
    faulthandler.dump_traceback_later(WAIT_S, exit=True)  # a stuck collective prints where it is, then exits
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world,))
        model = _model("cpu" if rank == 0 else "meta")
        state = model.state_dict() if rank == 0 else None
        shard_model(model, mesh)
        load_full_state(model, state)
        stats = _train(model, rank, world, mode, budget)
        final = full_state(model)
        if rank == 0:
            q.put((stats, {k: v.numpy() for k, v in final.items()}))  # numpy: a tensor would go by fd, gone at exit
    finally:
        dist.destroy_process_group()
        faulthandler.cancel_dump_traceback_later()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_ranks(mode: str, budget: int | None):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, 2, port, mode, budget, q), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    try:
        stats, arrays = q.get(timeout=WAIT_S + 30)  # bounded: a rank that dies leaves the queue empty
        final = {k: torch.from_numpy(v) for k, v in arrays.items()}
        for p in procs:
            p.join(timeout=60)
            assert p.exitcode == 0, f"rank exit code {p.exitcode}"
    finally:
        for p in procs:  # never leave a rank behind, whatever failed
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
    return stats, final


def _one_process(mode: str, budget: int | None):
    model = _model()
    stats = _train(model, 0, 1, mode, budget)
    return stats, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _compare(a, b, atol: float) -> None:
    (sa, fa), (sb, fb) = a, b
    for (la, na), (lb, nb) in zip(sa, sb):
        assert la == pytest.approx(lb, rel=1e-4, abs=1e-7)
        assert na == pytest.approx(nb, rel=1e-4)
    assert fa.keys() == fb.keys()
    diff = max(float((fa[k] - fb[k]).abs().max()) for k in fa)
    print(f"max |param difference| = {diff:.2e}")
    assert diff <= atol


@pytest.mark.slow
@pytest.mark.parametrize("mode", AGG_MODES)
def test_two_ranks_equal_one_process(mode):
    torch.set_num_threads(1)
    _compare(_one_process(mode, None), _two_ranks(mode, 16), atol=1e-5)


@pytest.mark.parametrize("budget", [8, 32, None])
def test_micro_batch_budget_does_not_change_the_update(budget):
    torch.set_num_threads(1)
    _compare(_one_process("token-mean", None), _one_process("token-mean", budget), atol=1e-5)


@pytest.mark.parametrize(
    "device, dtype, param, master",
    [
        ("cuda", "bfloat16", torch.bfloat16, "float32"),
        ("cuda:0", "float16", torch.float16, "float32"),
        ("cuda", "float32", None, "float32"),
        ("cpu", "bfloat16", None, "bfloat16"),
        ("cpu", "float32", None, "float32"),
    ],
)
def test_mixed_precision_on_gpus_only_with_fp32_reductions_and_masters(device, dtype, param, master):
    """On CUDA a 16-bit ``model.dtype`` computes in it over fp32 master weights, gradients reduced in fp32; on CPU
    (gloo) and for fp32 no policy: the ranks keep the model's own dtype, as the single process does."""
    from psrl.train.shard import master_dtype, mixed_precision

    mp = mixed_precision(device, dtype)
    assert (mp.param_dtype if mp is not None else None) == param
    assert mp is None or mp.reduce_dtype == torch.float32
    assert master_dtype(device, dtype) == master
