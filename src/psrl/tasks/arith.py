"""Single-turn arithmetic: ``<bos>3+5=`` -> ``8<eos>``; reward 1 for the right number.

Also holds what both built-in tasks share: tokenizer set-up (the built-in char tokenizer, or
a model's own tokenizer grown by the task's markers) and answer parsing.
"""

from __future__ import annotations

import random

from psrl.models.tokenizer import CharTokenizer
from psrl.tasks.base import Demo, Episode, GenerateFn, Prompt, Task

__all__ = ["ArithTask", "parse_int"]


def parse_int(text: str) -> int | None:
    """The integer a turn answers, or None when it is not a plain (optionally signed) integer."""
    t = text.strip()
    body = t[1:] if t.startswith("-") else t
    return int(t) if body.isdigit() and len(body) <= 6 else None


class BuiltinTask(Task):
    """Tokenizer plumbing of the built-in tasks (markers must be single tokens)."""

    markers = ["<eos>"]

    def __init__(self, task_cfg, seed: int = 0, tokenizer=None):
        self.cfg = task_cfg
        self.seed = seed
        self.tokenizer = tokenizer if tokenizer is not None else CharTokenizer()
        self.tokenizer.add_special_tokens([m for m in self.markers if m != "<eos>"])
        self.eos_id = self.tokenizer.eos_id
        bos = getattr(self.tokenizer, "bos_id", None)
        self._bos = [] if bos is None else [int(bos)]

    def encode_prompt(self, text: str) -> list[int]:
        """``<bos>`` (when the tokenizer has one) followed by the prompt text."""
        return self._bos + self.tokenizer.encode(text)

    def answer_ids(self, value) -> list[int]:
        """The tokens of a final answer: the number, then eos."""
        return self.tokenizer.encode(str(value)) + [self.eos_id]

    def final_answer(self, episode: Episode) -> int | None:
        """The integer of the episode's final answer turn (ends with eos), else None."""
        return episode.info.get("answer")


class ArithTask(BuiltinTask):
    """``a+b=`` with operands in ``[0, max_value]``; one turn, answered directly.

    ``demo_noise``: fraction of demonstrations that answer a random wrong number, so the warm
    start leaves room for RL.
    """

    warm_start_steps = 150

    def __init__(
        self, task_cfg, seed: int = 0, tokenizer=None, max_value: int = 9, demo_noise: float = 0.5, turn_tokens: int = 4
    ):
        super().__init__(task_cfg, seed, tokenizer)
        self.max_value = int(max_value)
        self.demo_noise = float(demo_noise)
        self.turn_tokens = int(turn_tokens)
        self.stop_ids = {self.eos_id}

    def sample_prompt(self, rng: random.Random) -> Prompt:
        """Two uniform operands."""
        a, b = rng.randint(0, self.max_value), rng.randint(0, self.max_value)
        text = f"{a}+{b}="
        return Prompt(uid=f"arith-{rng.getrandbits(48):012x}", ids=self.encode_prompt(text), answer=a + b, text=text)

    async def run_episode(self, prompt: Prompt, generate: GenerateFn, rng: random.Random) -> Episode:
        """One model turn; the answer is what precedes eos."""
        ep = Episode()
        seg = await generate(list(prompt.ids), self.turn_tokens)
        ep.add_model(seg)
        if seg.tokens and seg.tokens[-1] == self.eos_id:
            ep.info["answer"] = parse_int(self.tokenizer.decode(seg.tokens[:-1]))
        else:
            ep.truncated = True
        return ep

    def reward(self, prompt: Prompt, episode: Episode) -> dict[str, float]:
        """1.0 for the exact sum; every metric equals it in a single-turn task."""
        acc = float(self.final_answer(episode) == prompt.answer)
        return {"score": acc, "acc": acc, "seq_reward": acc, "seq_final_reward": acc}

    def demonstrations(self, n: int, rng: random.Random) -> list[Demo]:
        """Correct answers, except a ``demo_noise`` fraction of random wrong ones."""
        out = []
        for _ in range(n):
            p = self.sample_prompt(rng)
            value = p.answer
            if rng.random() < self.demo_noise:
                value = rng.choice([v for v in range(2 * self.max_value + 1) if v != p.answer])
            resp = self.answer_ids(value)
            out.append((p.ids, resp, [1] * len(resp)))
        return out
