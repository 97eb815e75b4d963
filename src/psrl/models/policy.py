"""The policy: a Hugging Face causal LM with one decode step, generation and log-prob recomputation.

Log-probabilities are always ``log_softmax(logits / temperature)`` of the sampled token. The
behaviour log-prob recorded at generation (:meth:`Policy.next_token`) and the log-prob the
trainer recomputes (:meth:`Policy.sequence_logprobs`) use the same formula, so for the same
weights and tokens they agree to float precision -- the importance ratios of the off-policy
corrections then measure only the policy change, not a bookkeeping mismatch.

``top_p`` only restricts *sampling* to the nucleus; the recorded log-prob stays the one of the
full tempered distribution (the distribution the trainer can recompute). With ``top_p < 1``
the recorded value is therefore not the exact sampling probability: that is the usual choice
of RL frameworks and keeps recorded and recomputed log-probs comparable.

``temperature <= 0`` means greedy decoding; log-probs are then those of temperature 1.

``next_token`` has no KV cache: every call runs the whole (left-padded) batch. It is the slow,
obviously-correct twin of the cached engine (:class:`psrl.rollout.engines.hf.HFEngine`), which the
tests check against it.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from psrl.models.builder import ModelRecipe, is_weightless

__all__ = ["Policy", "build_policy", "resolve_device", "sample", "inverse_cdf", "left_pad"]


class Policy:
    """A causal LM plus its tokenizer, a weight ``version`` and a seeded sampling generator."""

    def __init__(self, model, tokenizer, device: str = "cpu", seed: int = 0, recipe: ModelRecipe | None = None):
        self.model = model if is_weightless(model) else model.to(device)
        self.model.eval()  # no dropout ever: recorded and recomputed log-probs must agree
        self.tokenizer = tokenizer
        self.device = torch.device(device)
        self.pad_id = int(tokenizer.pad_id)
        self.version = 0
        self.generator = torch.Generator(device="cpu").manual_seed(int(seed))
        self.recipe = recipe
        """How ``model.*`` builds this policy's starting weights (:func:`build_policy`): what trainer ranks build
        from when the driver holds none (:attr:`weightless`); None for a policy built otherwise."""

    @property
    def weightless(self) -> bool:
        """Whether the model is on ``meta``: config, shapes and tokenizer only, no weights (a driver whose engines
        are vLLM servers or Ray actors and whose ranks build the model themselves)."""
        return is_weightless(self.model)

    # ------------------------------------------------------------------ decoding

    @torch.no_grad()
    def next_token(
        self,
        seqs: list[list[int]],
        temperature: float = 1.0,
        top_p: float = 1.0,
        uniforms: Sequence[float | None] | None = None,
    ) -> tuple[list[int], list[float]]:
        """One decode step for a batch of variable-length sequences: (sampled tokens, their log-probs).

        Sequences are left-padded with an attention mask and position ids that count only real
        tokens, so each row sees exactly what it would see alone. ``uniforms``: as :func:`sample`.
        """
        if not seqs:
            return [], []
        ids, mask = left_pad(seqs, self.pad_id, self.device)
        pos = (mask.cumsum(dim=1) - 1).clamp(min=0)
        logits = self._forward(ids, mask, pos, last_only=True)[:, -1, :]
        return sample(logits, temperature, top_p, self.generator, uniforms)

    def generate(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        stop_ids: Iterable[int] | None = None,
    ) -> list[tuple[list[int], list[float]]]:
        """Sample up to ``max_new_tokens`` per prompt; a row stops after emitting a stop token (kept)."""
        stop = set(stop_ids or ())
        out: list[tuple[list[int], list[float]]] = [([], []) for _ in prompts]
        active = list(range(len(prompts)))
        for _ in range(max_new_tokens):
            if not active:
                break
            toks, lps = self.next_token([list(prompts[i]) + out[i][0] for i in active], temperature, top_p)
            still = []
            for i, t, lp in zip(active, toks, lps):
                out[i][0].append(t)
                out[i][1].append(lp)
                if t not in stop:
                    still.append(i)
            active = still
        return out

    # ------------------------------------------------------------------ training

    def sequence_logprobs(
        self, prompt_ids: list[list[int]], response_ids: list[list[int]], temperature: float = 1.0
    ) -> Tensor:
        """``[B, T]`` log-probs of each response token given everything before it, right-padded with 0.

        Runs with gradients unless the caller disables them. Every response token is scored,
        tool-output tokens included; the caller masks those out.
        """
        full = [list(p) + list(r) for p, r in zip(prompt_ids, response_ids)]
        ids, mask = _right_pad(full, self.pad_id, self.device)
        pos = torch.arange(ids.shape[1], device=self.device).expand_as(ids)
        logits = self._forward(ids, mask, pos, last_only=False)
        t_max = max((len(r) for r in response_ids), default=0)
        if t_max == 0:
            return logits.new_zeros((len(full), 0))
        starts = torch.tensor([len(p) - 1 for p in prompt_ids], device=self.device)
        steps = torch.arange(t_max, device=self.device)
        where = (starts[:, None] + steps[None, :]).clamp(max=ids.shape[1] - 1)
        picked = logits.gather(1, where[:, :, None].expand(-1, -1, logits.shape[-1])).float()
        logp = F.log_softmax(picked / _temp(temperature), dim=-1)
        targets, valid = _right_pad(response_ids, 0, self.device)
        chosen = logp.gather(2, targets[:, :, None]).squeeze(2)
        return chosen * valid.to(chosen.dtype)

    # ------------------------------------------------------------------ weights

    def export_state(self) -> dict[str, Tensor]:
        """CPU copies of every weight (what a ParameterStore publishes)."""
        return {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()}

    def replica(self, seed: int) -> Policy:
        """An independent copy (same weights and version, its own sampling seed) for a rollout instance:
        cheaper than loading ``model.path`` again (a GGUF file is dequantized on every load). A :attr:`weightless`
        policy's replica is built from its :attr:`recipe` (the trainer ranks' start weights, which the engine then
        replaces with each published version it loads): the driver holds the engines' weights and no copy of its
        own (issue #33, item 5)."""
        if self.weightless:
            if self.recipe is None:
                raise RuntimeError("Policy.replica: a weightless policy without a recipe has no weights to copy")
            model = self.recipe(str(self.device))
        else:
            model = copy.deepcopy(self.model)
        for w in model.parameters():  # a rollout copy never trains: no gradients, no autograd
            w.grad = None
            w.requires_grad_(False)
        twin = Policy(model, self.tokenizer, device=str(self.device), seed=seed)
        twin.version = self.version
        return twin

    def save_pretrained(self, directory: str | Path) -> Path:
        """Write model and tokenizer as a Hugging Face directory (``AutoModelForCausalLM.from_pretrained``)."""
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        from transformers.utils import logging as hf_logging

        bars = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()  # one small shard: a progress bar only clutters psrl train's log
        try:
            self.model.save_pretrained(str(path))
        finally:
            if bars:
                hf_logging.enable_progress_bar()
        self.tokenizer.save_pretrained(path)
        (path / "psrl_version.txt").write_text(f"{self.version}\n")
        return path

    def load_weights(self, state: dict[str, Tensor], version: int) -> None:
        """Load published weights and take their version."""
        self.model.load_state_dict(state)
        self.version = int(version)

    def _forward(self, ids: Tensor, mask: Tensor, pos: Tensor, last_only: bool) -> Tensor:
        kw = {"logits_to_keep": 1} if last_only else {}
        return self.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False, **kw).logits


def sample(
    logits: Tensor,
    temperature: float,
    top_p: float,
    generator: torch.Generator,
    uniforms: Sequence[float | None] | None = None,
) -> tuple[list[int], list[float]]:
    """Sample one token per row of ``[B, vocab]`` logits: (tokens, log-probs of the tempered full distribution).

    Every engine of this process samples here, so the recorded behaviour log-prob is the formula
    the trainer recomputes (:meth:`Policy.sequence_logprobs`).

    ``uniforms`` (one per row, in ``[0, 1)``) makes each row's draw its own: the row takes the token where its
    number falls in its cumulative distribution (inverse-CDF sampling), so what a row samples depends on its
    logits and its number only, not on the other rows (:attr:`psrl.types.GenRequest.seed`). Rows without one
    (None) draw theirs from ``generator``; with no ``uniforms`` at all, every row is drawn from ``generator``
    by ``torch.multinomial``.
    """
    logp = F.log_softmax(logits.float() / _temp(temperature), dim=-1)
    if temperature <= 0:
        tokens = logp.argmax(dim=-1)
    else:
        probs = _nucleus(logp.exp(), top_p).cpu()
        if uniforms is None or all(u is None for u in uniforms):
            tokens = torch.multinomial(probs, 1, generator=generator).squeeze(1)
        else:
            u = [
                x if x is not None else float(torch.rand((), generator=generator, dtype=torch.float64))
                for x in uniforms
            ]
            tokens = inverse_cdf(probs, u)
        tokens = tokens.to(logp.device)
    chosen = logp.gather(1, tokens[:, None]).squeeze(1)
    return tokens.tolist(), chosen.tolist()


def inverse_cdf(probs: Tensor, uniforms: Sequence[float]) -> Tensor:
    """Per row of ``[B, vocab]`` (unnormalised) probabilities, the first token whose cumulative mass exceeds the
    row's number times the row's total: a draw from the row's distribution when the number is uniform. Sums in
    float64, row by row, so a row's token does not depend on the others; a zero-probability token is never taken.
    """
    cdf = probs.double().cumsum(dim=-1)
    target = torch.tensor(list(uniforms), dtype=torch.float64)[:, None] * cdf[:, -1:]
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp(max=probs.shape[-1] - 1)


def _temp(temperature: float) -> float:
    return float(temperature) if temperature > 0 else 1.0


def _nucleus(probs: Tensor, top_p: float) -> Tensor:
    """Zero the tail outside the smallest set of tokens whose mass reaches ``top_p`` (always keep the top one)."""
    if top_p >= 1.0:
        return probs
    sorted_p, order = probs.sort(dim=-1, descending=True)
    before = sorted_p.cumsum(dim=-1) - sorted_p
    sorted_p = torch.where(before < top_p, sorted_p, torch.zeros_like(sorted_p))
    return torch.zeros_like(probs).scatter(-1, order, sorted_p)


def left_pad(seqs: list[list[int]], pad: int, device) -> tuple[Tensor, Tensor]:
    """``(ids, mask)`` of ``seqs`` padded on the left to the longest (the batch KV cache of the ``hf`` engine too)."""
    n = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), n), pad, dtype=torch.long)
    mask = torch.zeros((len(seqs), n), dtype=torch.long)
    for i, s in enumerate(seqs):
        if s:
            ids[i, n - len(s) :] = torch.tensor(s, dtype=torch.long)
            mask[i, n - len(s) :] = 1
    return ids.to(device), mask.to(device)


def _right_pad(seqs: list[list[int]], pad: int, device) -> tuple[Tensor, Tensor]:
    n = max((len(s) for s in seqs), default=0)
    ids = torch.full((len(seqs), n), pad, dtype=torch.long)
    mask = torch.zeros((len(seqs), n), dtype=torch.long)
    for i, s in enumerate(seqs):
        if s:
            ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
            mask[i, : len(s)] = 1
    return ids.to(device), mask.to(device)


def resolve_device(device: str) -> str:
    """``auto`` -> ``cuda`` when available, else ``cpu``."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def build_policy(model_cfg, tokenizer_or_task, seed: int = 0, weights: bool = True) -> Policy:
    """Build the policy of ``model.*``: the tiny built-in GPT-2, or a local HF directory / GGUF file.

    ``tokenizer_or_task`` is a tokenizer or anything with a ``.tokenizer`` (a task). The built-in
    model takes its vocabulary size from it; a loaded model gets its embeddings resized when the
    task added marker tokens to the model's tokenizer. ``weights=False``: the architecture on ``meta`` only
    (:attr:`Policy.weightless`), its :attr:`Policy.recipe` what the trainer ranks build the weights from.
    """
    tok = getattr(tokenizer_or_task, "tokenizer", tokenizer_or_task)
    recipe = model_recipe(model_cfg, tok, seed)
    model = recipe("cpu" if weights else "meta")
    return Policy(model, tok, device=resolve_device(model_cfg.device), seed=seed, recipe=recipe)


def model_recipe(model_cfg, tok, seed: int = 0) -> ModelRecipe:
    """:class:`~psrl.models.builder.ModelRecipe` of ``model.*`` for the tokenizer ``tok``: ``model.path`` (its
    embeddings grown to the tokenizer's vocabulary), or the built-in GPT-2 of ``model.*`` sizes, from ``seed``."""
    config = None if model_cfg.path is not None else _tiny_gpt2_config(model_cfg, tok)
    return ModelRecipe(config, model_cfg.path, model_cfg.gguf_file or None, tok.vocab_size, seed, model_cfg.dtype)


def _tiny_gpt2_config(model_cfg, tok):
    """The built-in GPT-2 of ``model.*`` sizes (no download, no dropout)."""
    from transformers import GPT2Config

    return GPT2Config(
        vocab_size=tok.vocab_size,
        n_positions=model_cfg.n_positions,
        n_embd=model_cfg.n_embd,
        n_layer=model_cfg.n_layer,
        n_head=model_cfg.n_head,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=tok.bos_id,
        eos_token_id=tok.eos_id,
        pad_token_id=tok.pad_id,
    )
