"""Recorded behaviour log-probs == log-probs the trainer recomputes, for the same weights (to 1e-4).

Pins the contract the off-policy corrections rest on: ``Policy.next_token`` (left-padded,
batched, used at generation) and ``Policy.sequence_logprobs`` (right-padded, used in training)
compute ``log_softmax(logits / T)`` of the same token identically, including when tool output
sits inside the response and is masked out.
"""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from psrl.rollout.engines.base import turns
from psrl.rollout.engines.hf import HFEngine
from psrl.types import Sampling
from tests.models.helpers import masked_max_diff, tiny_policy

TOL = 1e-4


def _random_prompts(rng: random.Random, n: int, vocab: int) -> list[list[int]]:
    return [[rng.randrange(vocab) for _ in range(rng.randint(1, 12))] for _ in range(n)]


@pytest.mark.parametrize("temperature", [0.6, 1.0, 1.5])
def test_single_turn_generate_matches_recompute(temperature):
    """Batched generation of ragged prompts: every recorded log-prob is reproduced by sequence_logprobs."""
    policy = tiny_policy(seed=1)
    prompts = _random_prompts(random.Random(0), 7, policy.tokenizer.vocab_size)
    out = policy.generate(prompts, max_new_tokens=9, temperature=temperature, stop_ids={policy.tokenizer.eos_id})
    responses = [toks for toks, _ in out]
    with torch.no_grad():
        recomputed = policy.sequence_logprobs(prompts, responses, temperature)
    assert recomputed.shape == (len(prompts), max(len(r) for r in responses))
    assert masked_max_diff(recomputed, [lps for _, lps in out], [[1] * len(r) for r in responses]) < TOL


def test_padding_of_recomputed_logprobs_is_zero():
    """Rows shorter than the longest response are right-padded with exactly 0."""
    policy = tiny_policy()
    lp = policy.sequence_logprobs([[1, 5], [1]], [[7], [7, 8, 9]], 1.0)
    assert lp.shape == (2, 3)
    assert lp[0, 1:].abs().sum() == 0 and (lp[1] < 0).all()


def test_multi_turn_with_masked_tool_tokens_matches_recompute():
    """Model turns sampled with tool output in their context: recorded == recomputed on mask-1 tokens,
    and the tool tokens (mask 0) neither shift nor corrupt the model tokens after them."""
    policy = tiny_policy(seed=2)
    rng = random.Random(3)
    vocab = policy.tokenizer.vocab_size
    prompts = _random_prompts(rng, 5, vocab)
    responses, logprobs, masks = [[] for _ in prompts], [[] for _ in prompts], [[] for _ in prompts]
    for _turn in range(3):
        ctx = [p + r for p, r in zip(prompts, responses)]
        out = policy.generate(ctx, max_new_tokens=rng.randint(2, 6), temperature=1.0)
        for i, (toks, lps) in enumerate(out):
            tool = [rng.randrange(vocab) for _ in range(rng.randint(1, 4))]
            responses[i] += toks + tool
            logprobs[i] += lps + [0.0] * len(tool)
            masks[i] += [1] * len(toks) + [0] * len(tool)
    with torch.no_grad():
        recomputed = policy.sequence_logprobs(prompts, responses, 1.0)
    assert sum(map(sum, masks)) > 0 and sum(len(m) - sum(m) for m in masks) > 0
    assert masked_max_diff(recomputed, logprobs, masks) < TOL


def test_agentic_episodes_through_the_hf_engine_match_recompute(tool_task):
    """Real tool_arith episodes, decode steps of concurrent episodes batched by the hf engine (KV cache):
    recorded behaviour log-probs match the trainer's recomputation on every model token."""
    task, policy = tool_task
    rng = random.Random(4)
    prompts = [task.sample_prompt(rng) for _ in range(6)]
    engine = HFEngine(policy, sampling=Sampling(stop_ids=frozenset(task.stop_ids)))

    async def run_all():
        try:
            return await asyncio.gather(
                *[task.run_episode(p, turns(engine), random.Random(i)) for i, p in enumerate(prompts)]
            )
        finally:
            await engine.close()

    episodes = asyncio.run(run_all())
    with torch.no_grad():
        recomputed = policy.sequence_logprobs([p.ids for p in prompts], [e.response_ids for e in episodes], 1.0)
    assert any(0 in e.loss_mask for e in episodes), "no episode called the tool: the test would not test masking"
    assert engine.steps < sum(sum(e.loss_mask) for e in episodes), "decode steps were not batched"
    assert masked_max_diff(recomputed, [e.logprobs for e in episodes], [e.loss_mask for e in episodes]) < TOL
