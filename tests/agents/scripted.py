"""A model that says what a test scripts: turn ``k`` of a conversation samples ``script[k]`` token by token.

The turn is read off the context (how many assistant turns the chat template opened), so the same model serves
many conversations at once; every token's log-prob is ``-(k + 1) / 10`` and its version the model's, so a test can
tell turns and weights apart in what was captured.
"""

from __future__ import annotations

from psrl.models.tokenizer import CharTokenizer

HEADER = "<|im_start|>assistant\n"


class ScriptedModel:
    """A :class:`psrl.rollout.engines.base.TokenModel` whose turns are ``script`` (texts; eos is appended)."""

    def __init__(self, tokenizer: CharTokenizer, script: list[str], version: int = 0):
        self.tok = tokenizer
        self.turns = [tokenizer.encode(t) + [tokenizer.eos_id] for t in script]
        self.header = tokenizer.encode(HEADER)
        self.version = version
        self.sampled: list[list[int]] = []
        """Every token the model emitted, per call (the engine-side record the capture is compared with)."""

    def _where(self, seq: list[int]) -> tuple[int, int]:
        h, n = self.header, len(self.header)
        starts = [i for i in range(len(seq) - n + 1) if seq[i : i + n] == h]
        return len(starts) - 1, len(seq) - (starts[-1] + n)

    def next_token(self, seqs, temperature, top_p, uniforms=None):
        toks, lps = [], []
        for seq in seqs:
            k, done = self._where(list(seq))
            turn = self.turns[min(k, len(self.turns) - 1)]
            tok = turn[done] if done < len(turn) else self.tok.eos_id
            toks.append(tok)
            lps.append(-(k + 1) / 10)
            self.sampled.append([tok])
        return toks, lps

    def load_weights(self, state, version):
        self.version = version
