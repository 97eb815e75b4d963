"""Tokenizers behind one small interface: ``encode``, ``decode``, ``eos_id``, ``pad_id``, ``vocab_size``.

Two implementations:

* :class:`CharTokenizer` -- the built-in model's tokenizer, made with the ``tokenizers`` library:
  one token per printable ASCII character (plus newline and tab) and whole-token markers
  (``<eos>``, ``<call>`` ...). Nothing is downloaded; the vocabulary is fixed, so a tiny model
  built for it is reproducible, and any English dataset row tokenizes on the default model
  (a character outside the vocabulary is reported by :meth:`CharTokenizer.unknown`).
* :class:`HFTokenizer` -- wraps the tokenizer of a local Hugging Face model directory
  (``model.path``), loaded offline.

Tasks need their markers to be single tokens (a turn ends at a stop *token*), so both offer
:meth:`add_special_tokens`; the char tokenizer already has the built-in markers, an HF one grows
(and :func:`psrl.models.build_policy` then resizes the model's embeddings).
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["CharTokenizer", "HFTokenizer", "load_tokenizer", "MARKERS"]

MARKERS = ["<pad>", "<bos>", "<eos>", "<call>", "</call>", "<res>", "</res>"]
"""Whole-token markers of the built-in tasks (tool call, tool result, end of answer)."""
CHARS = "".join(chr(c) for c in range(32, 127)) + "\n\t"
"""Printable ASCII, newline and tab: what the built-in model can read and write."""


class CharTokenizer:
    """Character-level tokenizer (``tokenizers`` WordLevel over single characters + markers)."""

    chat_template = None
    """No chat template: chat messages reach the built-in model as their contents, one per line."""

    def __init__(self, chars: str = CHARS, markers: list[str] | None = None):
        from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

        markers = list(MARKERS if markers is None else markers)
        vocab = {tok: i for i, tok in enumerate(markers + ["<unk>"] + sorted(set(chars)))}
        tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
        tk.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")  # '.' skips newlines
        tk.decoder = decoders.Fuse()
        tk.add_special_tokens(markers)
        self._tk = tk
        self.eos_id = vocab["<eos>"]
        self.pad_id = vocab["<pad>"]
        self.bos_id: int | None = vocab.get("<bos>")
        self.unk_id = vocab["<unk>"]
        self.chars = frozenset(chars)

    def unknown(self, text: str) -> list[str]:
        """The characters of ``text`` this vocabulary cannot represent (they would become ``<unk>``)."""
        return sorted({c for c in text if c not in self.chars})

    @property
    def vocab_size(self) -> int:
        """Number of token ids (the model's embedding rows)."""
        return self._tk.get_vocab_size(with_added_tokens=True)

    def __len__(self) -> int:
        return self.vocab_size

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (markers become one token each; unknown characters ``<unk>``)."""
        return list(self._tk.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids``, markers included (the tasks parse them)."""
        return self._tk.decode(list(ids), skip_special_tokens=False)

    def token_id(self, token: str) -> int:
        """Id of one whole token; ``KeyError`` if it is not a single token."""
        tid = self._tk.token_to_id(token)
        if tid is None:
            raise KeyError(f"{token!r} is not a single token of this tokenizer")
        return tid

    def add_special_tokens(self, tokens: list[str]) -> None:
        """Make ``tokens`` single tokens (they must already be: the vocabulary is fixed)."""
        for t in tokens:
            self.token_id(t)

    def save_pretrained(self, directory: str | Path) -> None:
        """Write a Hugging Face fast tokenizer (``AutoTokenizer.from_pretrained(directory)`` loads it)."""
        from transformers import PreTrainedTokenizerFast

        names = {i: t for t, i in self._tk.get_vocab(with_added_tokens=True).items()}
        bos = None if self.bos_id is None else names[self.bos_id]
        PreTrainedTokenizerFast(
            tokenizer_object=self._tk,
            eos_token=names[self.eos_id],
            pad_token=names[self.pad_id],
            unk_token="<unk>",
            bos_token=bos,
        ).save_pretrained(str(directory))


class HFTokenizer:
    """A local Hugging Face tokenizer (``AutoTokenizer``, offline) behind the same interface."""

    def __init__(self, hf_tokenizer):
        self.hf = hf_tokenizer
        eos = hf_tokenizer.eos_token_id
        if eos is None:
            raise ValueError("model.path: the tokenizer has no eos token; the tasks need one to end an answer")
        self.eos_id = int(eos)
        pad = hf_tokenizer.pad_token_id
        self.pad_id = int(eos if pad is None else pad)
        self.bos_id = hf_tokenizer.bos_token_id

    @property
    def chat_template(self) -> str | None:
        """The model's chat template (None when it has none)."""
        return getattr(self.hf, "chat_template", None)

    def render_chat(self, messages: list[dict]) -> str:
        """``messages`` through the chat template, ending where the assistant's answer starts."""
        return self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def unknown(self, text: str) -> list[str]:
        """``["<unk>"]`` when ``text`` needs the unknown token, else ``[]`` (byte-level tokenizers never do)."""
        unk = self.hf.unk_token_id
        return ["<unk>"] if unk is not None and unk in self.encode(text) else []

    @property
    def vocab_size(self) -> int:
        """Number of token ids including added tokens (``len(tokenizer)``)."""
        return len(self.hf)

    def __len__(self) -> int:
        return self.vocab_size

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` without the model's own bos/eos decoration."""
        return list(self.hf.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids`` with special tokens kept (the tasks parse their markers)."""
        return self.hf.decode(list(ids), skip_special_tokens=False)

    def token_id(self, token: str) -> int:
        """Id of one whole token; ``KeyError`` if it encodes to more than one."""
        ids = self.encode(token)
        if len(ids) != 1:
            raise KeyError(f"{token!r} is not a single token of this tokenizer ({ids})")
        return ids[0]

    def add_special_tokens(self, tokens: list[str]) -> None:
        """Add the task's markers as whole tokens (the model's embeddings are resized to match)."""
        missing = [t for t in tokens if t not in self.hf.get_vocab()]
        if missing:
            self.hf.add_tokens(missing, special_tokens=True)

    def save_pretrained(self, directory: str | Path) -> None:
        """Write the tokenizer (with the task's added markers) in Hugging Face format."""
        self.hf.save_pretrained(str(directory))


def load_tokenizer(model_cfg) -> HFTokenizer | None:
    """The tokenizer of ``model.path`` (offline), or ``None`` for the built-in model (tasks bring theirs)."""
    if model_cfg.path is None:
        return None
    from transformers import AutoTokenizer

    kw = {"local_files_only": True}
    if model_cfg.gguf_file:
        kw["gguf_file"] = model_cfg.gguf_file
    return HFTokenizer(AutoTokenizer.from_pretrained(model_cfg.path, **kw))
