"""Dataset tasks (``task.name: dataset``): prompts and answers from your own JSONL, Parquet or CSV files.

Rows are read with the Hugging Face ``datasets`` library and the keys verl uses
(``data.train_files``, ``data.prompt_key``, ...), so verl's preprocessed parquet files work as
they are: ``prompt`` a list of chat messages, the answer at ``reward_model.ground_truth``,
``data_source`` and ``extra_info`` passed to the reward. A prompt that is a list of messages
goes through the tokenizer's chat template when it has one (else the contents, one per line).

Every row is checked when the task is built, so a bad file fails before training starts with a
message naming the file, the row and the key: a missing key, an empty prompt, a character the
tokenizer cannot represent, a prompt longer than ``data.max_prompt_length`` (dropped and counted
instead with ``data.filter_overlong_prompts: true``, as in verl).

The training order is the task's own: a permutation per epoch seeded by ``trainer.seed``, walked
by a cursor that checkpoints save (:meth:`DatasetTask.state`), so a resumed run continues the
epoch instead of restarting it.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from psrl.errors import ConfigError, PsrlError
from psrl.models.tokenizer import CharTokenizer
from psrl.tasks.base import Demo, Episode, GenerateFn, Prompt, Task
from psrl.tasks.rewards import build_reward

__all__ = ["DatasetTask", "DataError", "load_rows"]

log = logging.getLogger(__name__)

_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


class DataError(PsrlError, ValueError):
    """A dataset file or row cannot be used; the message names the file, the row and the key."""


@dataclass
class Row:
    """One usable row: where it came from and what the reward needs."""

    file: str
    index: int
    text: str
    ids: list[int]
    answer: Any
    data_source: str = ""
    extra_info: Any = field(default_factory=dict)
    raw: dict = field(default_factory=dict)
    """The row as read (an agent receives it whole)."""

    @property
    def where(self) -> str:
        return f"{self.file} row {self.index}"


def load_rows(files: list[str], key: str) -> list[tuple[str, int, dict]]:
    """``(file, row index, row)`` of every row of ``files`` (``key`` names the config key in errors)."""
    out = []
    for f in files:
        path = Path(f)
        if not path.exists():
            raise ConfigError(key, f"file not found: {f}", "give an existing .jsonl, .json, .parquet or .csv file")
        fmt = _FORMATS.get(path.suffix.lower())
        if fmt is None:
            raise ConfigError(key, f"unknown file type {path.suffix!r} of {f}", "use .jsonl, .json, .parquet or .csv")
        out += [(f, i, row) for i, row in enumerate(_read(path, fmt))]
    return out


def _read(path: Path, fmt: str) -> list[dict]:
    """The rows of one file as dicts. ``datasets`` caches an Arrow copy; the rows are kept in memory
    here, so that copy goes into a temporary directory instead of growing a cache per file."""
    import tempfile

    import datasets

    datasets.disable_progress_bars()
    with tempfile.TemporaryDirectory(prefix="psrl-data-") as cache:
        try:
            ds = datasets.load_dataset(fmt, data_files=str(path), split="train", cache_dir=cache)
        except Exception as e:  # a malformed line: the library's message says where
            raise DataError(f"{path}: cannot read as {fmt}: {e}") from e
        return list(ds)


def dig(row: dict, dotted: str) -> Any:
    """``row[a][b]...`` for ``dotted = "a.b"``; a column whose own name has dots is found first."""
    if dotted in row:
        return row[dotted]
    node: Any = row
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            raise KeyError(part)
        node = node[part]
    return node


class DatasetTask(Task):
    """One model turn per row, answered before ``<eos>``; scored by ``task.reward`` against the row's answer."""

    warm_start_steps = 0

    def __init__(self, task_cfg, seed: int = 0, tokenizer=None, data=None):
        if data is None:
            raise ConfigError("data", "task.name=dataset needs the data section", "set data.train_files")
        self.cfg, self.data, self.seed = task_cfg, data, int(seed)
        self.tokenizer = tokenizer if tokenizer is not None else CharTokenizer()
        self.eos_id = self.tokenizer.eos_id
        self.stop_ids = {self.eos_id}
        bos = getattr(self.tokenizer, "bos_id", None)
        self._bos = [] if bos is None else [int(bos)]
        self.max_context = data.max_prompt_length + len(self._bos) + data.max_response_length
        self.turn_tokens = data.max_response_length  # at most trainer.max_new_tokens (checked when the run is built)
        self.reward_fn = build_reward(
            task_cfg.reward, task_cfg.reward_timeout, task_cfg.reward_workers, judge=task_cfg.judge
        )
        self.dropped = 0
        self.rows = self._rows(self.data.train_files, "data.train_files")
        if not self.rows:
            raise DataError(
                f"data.train_files: no usable rows in {data.train_files}"
                + (f" ({self.dropped} over-long prompts were dropped)" if self.dropped else "")
            )
        self._val: list[Row] | None = None
        self.epoch, self.cursor, self.draws = 0, 0, 0
        self.order = self._order(0)

    # ------------------------------------------------------------------ rows

    def _rows(self, files: list[str], key: str) -> list[Row]:
        rows = []
        for f, i, raw in load_rows(list(files), key):
            row = self._row(f, i, raw)
            if row is not None:
                rows.append(row)
        if self.dropped:
            log.warning(
                "%s: dropped %d prompts longer than data.max_prompt_length=%d",
                key,
                self.dropped,
                self.data.max_prompt_length,
            )
        return rows

    def _row(self, f: str, i: int, raw: dict) -> Row | None:
        d = self.data
        where = f"{f} row {i}"
        prompt, answer = (
            self._column(raw, where, n, k) for n, k in (("prompt", d.prompt_key), ("answer", d.answer_key))
        )
        text = self.render(prompt, where)
        bad: list[str] = getattr(self.tokenizer, "unknown", lambda _t: [])(text)
        if bad:
            raise DataError(
                f"{where}: the tokenizer cannot represent {''.join(bad)!r} in data.prompt_key="
                f"{d.prompt_key!r} (the built-in model reads printable ASCII; use a model.path "
                "with its own tokenizer, or clean the row)"
            )
        ids = self._bos + self.tokenizer.encode(text)
        if len(ids) > d.max_prompt_length:
            if d.filter_overlong_prompts:
                self.dropped += 1
                return None
            raise DataError(
                f"{where}: prompt has {len(ids)} tokens > data.max_prompt_length={d.max_prompt_length} "
                "(set data.filter_overlong_prompts=true to drop such rows, or raise the limit)"
            )
        extra = raw.get("extra_info")
        extra = extra if extra is not None else {}
        return Row(f, i, text, ids, answer, str(raw.get("data_source") or ""), extra, raw)

    @staticmethod
    def _column(raw: dict, where: str, name: str, key: str) -> Any:
        """The row's value at ``data.<name>_key`` (a dotted path), or a DataError naming the key and the columns."""
        try:
            return dig(raw, key)
        except KeyError:
            raise DataError(f"{where}: no {name} at data.{name}_key={key!r} (columns: {sorted(raw)})") from None

    def render(self, prompt: Any, where: str) -> str:
        """The prompt text: a string as is; chat messages through the chat template (else their contents)."""
        if isinstance(prompt, str):
            if not prompt:
                raise DataError(f"{where}: empty prompt at data.prompt_key={self.data.prompt_key!r}")
            return prompt
        if isinstance(prompt, list) and prompt and all(isinstance(m, dict) and "content" in m for m in prompt):
            if getattr(self.tokenizer, "chat_template", None):
                return self.tokenizer.render_chat(prompt)
            return "\n".join(str(m["content"]) for m in prompt)
        raise DataError(
            f"{where}: data.prompt_key={self.data.prompt_key!r} holds {type(prompt).__name__}; "
            "expected a string or a list of {role, content} messages"
        )

    def _prompt(self, row: Row, uid: str) -> Prompt:
        return Prompt(
            uid=uid,
            ids=list(row.ids),
            answer=row.answer,
            text=row.text,
            info={"data_source": row.data_source, "extra_info": row.extra_info, "where": row.where, "row": row.raw},
        )

    # ------------------------------------------------------------------ order and cursor

    def _order(self, epoch: int) -> list[int]:
        idx = list(range(len(self.rows)))
        if self.data.shuffle:
            random.Random(f"{self.seed}/epoch{epoch}").shuffle(idx)
        return idx

    def sample_prompt(self, rng: random.Random) -> Prompt:
        """The next row of this epoch's order (``rng`` is not used: the order is the task's, and checkpointed)."""
        if self.cursor >= len(self.order):
            self.epoch += 1
            self.cursor = 0
            self.order = self._order(self.epoch)
        row = self.rows[self.order[self.cursor]]
        self.cursor += 1
        self.draws += 1
        return self._prompt(row, f"d{self.draws - 1}-r{row.index}")

    def state_dict(self) -> dict:
        """Where the training order stands (saved in checkpoints)."""
        return {"epoch": self.epoch, "cursor": self.cursor, "draws": self.draws}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.cursor, self.draws = int(state["epoch"]), int(state["cursor"]), int(state["draws"])
        self.order = self._order(self.epoch)

    def val_prompts(self, n: int = 0) -> list[Prompt]:
        """Every row of ``data.val_files`` (read on first use), in file order."""
        if self._val is None:
            self._val = self._rows(self.data.val_files, "data.val_files")
        return [self._prompt(r, f"val-r{k}") for k, r in enumerate(self._val)]

    # ------------------------------------------------------------------ episode and reward

    async def run_episode(self, prompt: Prompt, generate: GenerateFn, rng: random.Random) -> Episode:
        """One model turn of at most ``data.max_response_length`` tokens; the answer is what precedes eos."""
        ep = Episode()
        seg = await generate(list(prompt.ids), self.data.max_response_length)
        ep.add_model(seg)
        toks = seg.tokens
        if toks and toks[-1] == self.eos_id:
            toks = toks[:-1]
        else:
            ep.truncated = True
        ep.info["solution"] = self.tokenizer.decode(toks)
        return ep

    async def reward(self, prompt: Prompt, episode: Episode) -> dict[str, float]:
        """``task.reward`` on the decoded answer (verl's compute_score arguments); raises RewardError naming the row."""
        info = prompt.info
        return await self.reward_fn(
            info.get("data_source", ""),
            episode.info.get("solution", ""),
            prompt.answer,
            info.get("extra_info", {}),
            where=info.get("where", prompt.uid),
        )

    def demonstrations(self, n: int, rng: random.Random) -> list[Demo]:
        """The reference answer of random rows, then eos (for ``trainer.warm_start_steps > 0``)."""
        out = []
        for _ in range(n):
            row = self.rows[rng.randrange(len(self.rows))]
            resp = self.tokenizer.encode(str(row.answer))[: self.data.max_response_length - 1] + [self.eos_id]
            out.append((list(row.ids), resp, [1] * len(resp)))
        return out
