"""Agentic arithmetic with a calculator tool that is slow, heavy-tailed and only adds two numbers.

Prompt ``<bos>12+34+56=``. The tool adds exactly two numbers, so a problem with ``k``
operands takes ``k - 1`` calls and ``k`` model turns (trajectory lengths vary)::

    <call>12+34</call>  <res>46</res>  <call>46+56</call>  <res>102</res>  102<eos>
    \\_ model turn _/    \\_ tool, masked _/ ...                            \\_ final turn

A model turn ends at ``</call>`` (a tool call) or ``<eos>`` (the answer). Each call waits a
lognormal latency (``task.tool_latency_median``, ``task.tool_latency_sigma``) drawn from the
episode's rng. A malformed call gets ``<res>?</res>``. At most ``task.max_turns`` model turns.

Why RL has room: the tiny model cannot add two-digit numbers itself, only copy them. Every
scripted demo copies arguments and results exactly, but a ``demo_lazy_prob`` fraction of them
stops calling early and answers the running sum (after ``j`` calls, ``j`` uniform in
``[0, k-2]``: wrong). The warm-started policy therefore copies well but often answers too
early; the reward rises as RL learns to keep calling until every operand is used.
"""

from __future__ import annotations

import asyncio
import random

from psrl.tasks.arith import BuiltinTask, parse_int
from psrl.tasks.base import Demo, Episode, GenerateFn, Prompt, lognormal_latency

__all__ = ["ToolArithTask"]


class ToolArithTask(BuiltinTask):
    """Sum of 2..``max_turns`` operands in ``[0, max_value]`` with a two-operand adding tool."""

    markers = ["<eos>", "<call>", "</call>", "<res>", "</res>"]
    warm_start_steps = 1200

    def __init__(
        self,
        task_cfg,
        seed: int = 0,
        tokenizer=None,
        max_value: int = 99,
        max_operands: int = 3,
        demo_lazy_prob: float = 0.9,
        turn_tokens: int = 10,
    ):
        super().__init__(task_cfg, seed, tokenizer)
        self.max_value = int(max_value)
        self.max_operands = max(2, min(int(max_operands), int(task_cfg.max_turns)))
        self.demo_lazy_prob = float(demo_lazy_prob)
        self.turn_tokens = int(turn_tokens)
        tk = self.tokenizer
        self.call_id, self.end_call_id = tk.token_id("<call>"), tk.token_id("</call>")
        self.res_id, self.end_res_id = tk.token_id("<res>"), tk.token_id("</res>")
        self.stop_ids = {self.eos_id, self.end_call_id}

    def sample_prompt(self, rng: random.Random) -> Prompt:
        """2..max_operands uniform operands."""
        ops = [rng.randint(0, self.max_value) for _ in range(rng.randint(2, self.max_operands))]
        text = "+".join(map(str, ops)) + "="
        return Prompt(uid=f"tool-{rng.getrandbits(48):012x}", ids=self.encode_prompt(text), answer=sum(ops), text=text)

    def tool_latency(self, rng: random.Random) -> float:
        """Seconds one tool call takes (lognormal; one rng draw per call)."""
        return lognormal_latency(rng, self.cfg.tool_latency_median, self.cfg.tool_latency_sigma)

    def tool(self, call_tokens: list[int]) -> str:
        """Result text of a call turn ``<call>a+b</call>``: the sum, or ``?`` when malformed."""
        if len(call_tokens) < 2 or call_tokens[0] != self.call_id:
            return "?"
        parts = self.tokenizer.decode(call_tokens[1:-1]).split("+")
        nums = [parse_int(p) for p in parts]
        if len(nums) != 2:
            return "?"
        a, b = nums
        if a is None or b is None or a < 0 or b < 0:
            return "?"
        return str(a + b)

    async def run_episode(self, prompt: Prompt, generate: GenerateFn, rng: random.Random) -> Episode:
        """Alternate model turns and tool calls until an answer, a cut-off turn, or ``max_turns``."""
        ep = Episode()
        for _ in range(self.cfg.max_turns):
            seg = await generate(list(prompt.ids) + ep.response_ids, self.turn_tokens)
            ep.add_model(seg)
            last = seg.tokens[-1] if seg.tokens else None
            if last == self.eos_id:
                ep.info["answer"] = parse_int(self.tokenizer.decode(seg.tokens[:-1]))
                return ep
            if last != self.end_call_id:
                ep.truncated = True
                return ep
            result = self.tool(seg.tokens)
            ep.tool_calls += 1
            ep.info["bad_calls"] = ep.info.get("bad_calls", 0) + (result == "?")
            await asyncio.sleep(self.tool_latency(rng))
            ep.add_tool([self.res_id] + self.tokenizer.encode(result) + [self.end_res_id])
        return ep

    def reward(self, prompt: Prompt, episode: Episode) -> dict[str, float]:
        """``score = acc``: 1.0 for the exact sum. ``seq_reward`` also subtracts 0.1 per malformed call; ``tool_calls``
        counts the calls (batch/tool_call_frac)."""
        acc = float(self.final_answer(episode) == prompt.answer)
        return {
            "score": acc,
            "acc": acc,
            "seq_reward": acc - 0.1 * episode.info.get("bad_calls", 0),
            "seq_final_reward": acc,
            "tool_calls": float(episode.tool_calls),
        }

    def expert_response(self, prompt_text: str, calls: int | None = None) -> tuple[list[int], list[int]]:
        """The scripted expert: add left to right with the tool, then answer. (response_ids, loss_mask).

        ``calls`` < k - 1 gives a lazy demo that answers the running sum after that many calls.
        """
        ops = [int(x) for x in prompt_text.rstrip("=").split("+")]
        calls = len(ops) - 1 if calls is None else calls
        ids: list[int] = []
        mask: list[int] = []
        acc = ops[0]
        for b in ops[1 : calls + 1]:
            call = [self.call_id] + self.tokenizer.encode(f"{acc}+{b}") + [self.end_call_id]
            acc += b
            res = [self.res_id] + self.tokenizer.encode(str(acc)) + [self.end_res_id]
            ids += call + res
            mask += [1] * len(call) + [0] * len(res)
        ans = self.answer_ids(acc)
        return ids + ans, mask + [1] * len(ans)

    def demonstrations(self, n: int, rng: random.Random) -> list[Demo]:
        """The expert; a ``demo_lazy_prob`` fraction stops calling early and answers a partial sum."""
        out = []
        for _ in range(n):
            p = self.sample_prompt(rng)
            k = p.text.count("+") + 1
            calls = rng.randint(0, k - 2) if rng.random() < self.demo_lazy_prob else k - 1
            resp, mask = self.expert_response(p.text, calls)
            out.append((p.ids, resp, mask))
        return out
