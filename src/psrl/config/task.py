"""The ``task.*`` and ``data.*`` sections: what is trained on (a built-in task, a task class, or dataset rows
and their reward) and the files a dataset task reads. Their checks against other sections take the keys they
need as arguments (:meth:`TaskConfig.check`, :meth:`DataConfig.check`), called from
:meth:`psrl.config.schema.Config.validate`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from psrl.config.fields import _f, _sub
from psrl.config.rules import check_task, require
from psrl.errors import ConfigError

if TYPE_CHECKING:
    from psrl.config.schema import ModelConfig

__all__ = ["DataConfig", "JudgeConfig", "TaskConfig"]

# --------------------------------------------------------------------------- task.*

JUDGE_PROMPT = (
    "Grade an answer. Question: {question} Reference answer: {ground_truth} Answer to grade: {answer} "
    "Reply 'Score: 1' if it is correct, else 'Score: 0'."
)


@dataclass(frozen=True)
class JudgeConfig:
    url: str = _f(
        "",
        "task.reward=judge: base URL of an OpenAI-compatible server that grades (http://host:port/v1).",
        note="a URL (task.reward=judge needs it or task.judge.path)",
    )
    path: str = _f(
        "",
        "task.reward=judge: a Hugging Face model directory psrl serves as the judge itself: a vLLM server of the "
        "run's own (rollout.vllm.python's environment, rollout.vllm.kv_cache_gb), frozen weights, started before "
        "the run and stopped with it, on loopback; instead of task.judge.url.",
        note="a model directory (instead of task.judge.url)",
    )
    model: str = _f("judge", "task.reward=judge: the model name the judge server serves.", note="a model name")
    api_key: str = _f("EMPTY", "task.reward=judge: the bearer token sent to the judge.", note="a string")
    prompt: str = _f(
        JUDGE_PROMPT,
        "task.reward=judge: the one user message sent; {question} (the row's extra_info.question), {answer}, "
        "{ground_truth} and {data_source} are filled in.",
        note="a Python format string with those four names",
    )
    parse: str = _f(
        r"Score:\s*(-?[0-9]+(?:\.[0-9]+)?)",
        "task.reward=judge: regular expression whose first match in the reply (group 1, else the match) is the score.",
        note="a regular expression",
    )
    concurrency: int = _f(8, "task.reward=judge: most judge requests in flight at once (the rest queue).", ge=1)
    retries: int = _f(
        2, "task.reward=judge: retries of one judge call (HTTP error, timeout, unparsable reply) before it fails.", ge=0
    )
    timeout: float = _f(10.0, "task.reward=judge: seconds one judge request may take.", gt=0)
    max_tokens: int = _f(32, "task.reward=judge: most tokens of the judge's reply.", ge=1)

    def check(self, reward_timeout: float) -> None:
        """The judge is reachable in principle, its prompt and rule are usable, and its retries fit in
        ``task.reward_timeout`` (so a hanging judge fails the call, visibly, before the reward's own timeout)."""
        import re

        if self.path:
            require(
                not self.url,
                "task.judge.path",
                f"task.judge.path={self.path!r} and task.judge.url={self.url!r} both name a judge",
                "keep one: task.judge.path (psrl serves it) or task.judge.url (a server of yours)",
            )
            require(
                (Path(self.path) / "config.json").is_file(),
                "task.judge.path",
                f"{self.path!r} is not a Hugging Face model directory (no config.json)",
                "give a directory that transformers' from_pretrained loads",
            )
        else:
            require(
                self.url.startswith(("http://", "https://")),
                "task.judge.url",
                f"task.reward is judge but task.judge.url={self.url!r} is not an http(s) URL",
                "set task.judge.url=http://host:port/v1, or task.judge.path=MODEL_DIR for a judge psrl serves",
            )
        try:
            self.prompt.format(question="", answer="", ground_truth="", data_source="")
        except (KeyError, IndexError, ValueError, AttributeError) as e:
            raise ConfigError(
                "task.judge.prompt",
                f"cannot be filled in ({type(e).__name__}: {e})",
                "use only {question}, {answer}, {ground_truth} and {data_source}; write other braces as {{ }}",
            ) from None
        try:
            re.compile(self.parse)
        except re.error as e:
            raise ConfigError("task.judge.parse", f"bad regular expression: {e}", "fix the pattern") from None
        worst = (self.retries + 1) * self.timeout
        require(
            worst <= reward_timeout,
            "task.judge.timeout",
            f"(task.judge.retries + 1) * task.judge.timeout = {worst:g}s > task.reward_timeout = {reward_timeout:g}s",
            "lower task.judge.timeout or task.judge.retries, or raise task.reward_timeout",
        )


@dataclass(frozen=True)
class TaskConfig:
    name: str = _f(
        "tool_arith",
        "Built-in task name (arith, tool_arith), dataset (rows of data.train_files), agent (task.agent plays "
        "each row through an OpenAI-compatible endpoint; docs/agents.md), verifiers (a verifiers environment, "
        "task.verifiers, through the same endpoint) or module:Class.",
        note="arith | tool_arith | dataset | agent | verifiers (psrl.tasks.TASKS) | module:Class, resolved at load",
    )
    kwargs: dict = _f(
        {},
        "Extra keyword arguments for the task constructor.",
        note="keyword arguments the task class accepts (checked against its signature)",
    )
    reward: str = _f(
        "math",
        "Dataset tasks: math (math-verify) | exact | judge (task.judge asks a model) | regex:<pattern> (group 1, else "
        "the match, equals the answer) | "
        "module:function or file.py:function (verl's compute_score(data_source, solution_str, ground_truth, extra_info), "
        "sync or async, returning a float or a dict with score and optional acc). Built-in tasks keep their own reward.",
        note="math | exact | judge | regex:<pattern> | module:function | file.py:function",
    )
    reward_timeout: float = _f(
        30.0,
        "Seconds one reward call may take (dataset rewards, and any task's async reward); a timeout "
        "counts as a failure (retried task.reward_retries times, then status error).",
        gt=0,
    )
    reward_retries: int = _f(
        1,
        "Times a failing reward function / agent loop is retried before it is reported.",
        ge=0,
        fix="set task.reward_retries=0 to report a failing reward at once, or a small count",
    )
    reward_workers: int = _f(
        4,
        "Threads of the executor that runs synchronous reward functions (their own, not the event loop's default "
        "executor the trainer also uses); a reward that never returns holds one until the run ends.",
        ge=1,
    )
    agent: str = _f(
        "",
        "task.name=agent: the agent, async def agent(client, row) as module:function or path/to/file.py:function; "
        "client is an openai.AsyncOpenAI bound to the trajectory, row the dataset row. It returns a float, a dict "
        "with score, or None (then task.reward scores its last assistant message).",
        note="module:function | file.py:function (needed when task.name is agent)",
    )
    demonstration: str = _f(
        "",
        "task.name=agent: def demonstration(row) as module:function or path/to/file.py:function, returning one "
        "whole conversation for a row ({messages, tools}, as the agent sends it) whose assistant turns the "
        "supervised warm start (trainer.warm_start_steps) teaches, rendered as the endpoint renders requests.",
        note="module:function | file.py:function (needed for an agent task's warm start)",
    )
    verifiers: str = _f(
        "",
        "task.name=verifiers: a function returning a verifiers.Environment of verifiers' classic stack (0.3.1: "
        "vf.ToolEnv, vf.MultiTurnEnv; docs/agents.md), as module:function or path/to/file.py:function. Its dataset "
        "gives the rows (eval_dataset the validation rows), its rollout plays each through the agent endpoint, and "
        "its rubric is the reward.",
        note="module:function | file.py:function (needed when task.name is verifiers)",
    )
    agent_timeout: float = _f(
        300.0,
        "task.name=agent: seconds one agent episode may take (all its turns and tools); past it the episode "
        "fails (retried task.reward_retries times, then status error).",
        gt=0,
    )
    chat_template: str = _f(
        "auto",
        "task.name=agent: how requests become prompt text. auto: the tokenizer's template, or psrl's Hermes-style "
        "one for requests that offer tools the tokenizer's ignores (said once in the log); tokenizer: always the "
        "tokenizer's (tools it ignores are an error); hermes: always psrl's; or a path to a .jinja template.",
        note="auto | tokenizer | hermes | path to a .jinja file",
    )
    tool_parser: str = _f(
        "hermes",
        "task.name=agent: how sampled text becomes OpenAI tool_calls. hermes: <tool_call>{name, arguments}"
        "</tool_call> JSON (Hermes, Qwen); none: never.",
        choices=("hermes", "none"),
    )
    agent_history: str = _f(
        "error",
        "task.name=agent: what happens when a request's rendered prompt does not extend the tokens the trajectory "
        "holds (history rewritten: a template whose generation prompt opens <think> but whose history drops it "
        "with the reasoning, or an agent that edits earlier answers). error: the request "
        "fails (400 history_mismatch); split: the tokens so far close one training sequence and a new one starts "
        "from the rendered prompt (re-prefilled); the episode stays one trajectory, its sequences share its reward "
        "and advantage, and the trainer gets each as its own row.",
        choices=("error", "split"),
    )
    judge: JudgeConfig = _sub(JudgeConfig, "task.reward=judge: the OpenAI-compatible judge that scores answers.")
    tool_latency_median: float = _f(0.05, "Agentic task: median tool latency in seconds (lognormal).", ge=0)
    tool_latency_sigma: float = _f(1.0, "Agentic task: sigma of the lognormal tool latency (heavy tail).", ge=0)
    max_turns: int = _f(3, "Agentic task: maximum model turns per trajectory.", ge=1)

    def check(self, model: ModelConfig, seed: int) -> None:
        """``name`` resolves to a task class whose constructor takes ``kwargs`` (built with ``seed``), the
        built-in model (``model.path`` null) holds its longest context, and ``reward`` names a reward."""
        longest = getattr(check_task(self, seed), "max_context", 0)
        require(
            model.path is not None or not isinstance(longest, int) or model.n_positions >= longest,
            "model.n_positions",
            f"{model.n_positions} positions are fewer than the longest context of task {self.name} ({longest})",
            f"set model.n_positions >= {longest}",
        )
        r = self.reward  # regex:<pattern>, module:function and file.py:function all hold a ':'
        if r not in ("math", "exact", "judge"):
            require(
                ":" in r,
                "task.reward",
                f"unknown reward {r!r}",
                "use math, exact, judge, regex:<pattern> or module:function",
            )
        if r == "judge":
            self.judge.check(self.reward_timeout)
        if self.name == "agent":
            require(
                ":" in self.agent and self.agent.rsplit(":", 1)[1].isidentifier(),
                "task.agent",
                f"task.name is agent but task.agent={self.agent!r} names no function",
                "set task.agent=module:function or path/to/file.py:function",
            )
        if self.name == "verifiers":
            require(
                ":" in self.verifiers and self.verifiers.rsplit(":", 1)[1].isidentifier(),
                "task.verifiers",
                f"task.name is verifiers but task.verifiers={self.verifiers!r} names no function",
                "set task.verifiers=module:function or path/to/file.py:function",
            )
            import importlib.util

            require(
                importlib.util.find_spec("verifiers") is not None,
                "task.name",
                "task.name is verifiers but the verifiers package is not installed",
                "pip install -e '.[agents,verifiers]' (verifiers 0.3.1)",
            )
        if self.demonstration:
            require(
                ":" in self.demonstration and self.demonstration.rsplit(":", 1)[1].isidentifier(),
                "task.demonstration",
                f"task.demonstration={self.demonstration!r} names no function",
                "set task.demonstration=module:function or path/to/file.py:function, or leave it empty",
            )
        t = self.chat_template
        require(
            t in ("auto", "tokenizer", "hermes") or Path(t).is_file(),
            "task.chat_template",
            f"{t!r} is neither auto, tokenizer, hermes nor an existing template file",
            "use auto, tokenizer, hermes or the path of a .jinja file",
        )


# --------------------------------------------------------------------------- data.*


@dataclass(frozen=True)
class DataConfig:
    train_files: list = _f(
        [],
        "task.name=dataset or agent: training rows, one file or a list (.jsonl, .json, .parquet, .csv).",
        note="file paths, checked when the task is built",
    )
    val_files: list = _f(
        [],
        "Validation rows (same format); needed when trainer.val_every > 0 on a dataset task.",
        note="file paths, checked when the task is built",
    )
    prompt_key: str = _f(
        "prompt", "Column of the prompt: a string, or a list of chat messages ({role, content}).", note="a column name"
    )
    answer_key: str = _f(
        "reward_model.ground_truth",
        "Dotted path to the reference answer in a row (verl's preprocessed files need no change).",
        note="a dotted path into the row",
    )
    max_prompt_length: int = _f(
        96,
        "Prompt tokens allowed (after the chat template, with <bos>); longer rows are an error unless filtered.",
        ge=1,
    )
    max_response_length: int = _f(32, "Tokens the model may generate per answer.", ge=1)
    filter_overlong_prompts: bool = _f(
        False, "Drop (and count) prompts longer than max_prompt_length instead of failing."
    )
    shuffle: bool = _f(True, "Shuffle the training rows every epoch (by trainer.seed); the position is checkpointed.")

    def check(self, task_name: str, val_every: int, model: ModelConfig) -> None:
        """A dataset task (``task_name``) needs training rows, validation rows when ``val_every`` > 0 (from
        ``trainer.val_every``), and a built-in ``model`` long enough for a prompt and its answer."""
        if task_name == "verifiers":
            require(
                not self.train_files and not self.val_files,
                "data.train_files" if self.train_files else "data.val_files",
                "task.name is verifiers: its rows are the environment's dataset and eval_dataset, not data files",
                "remove data.train_files and data.val_files",
            )
            return
        if task_name not in ("dataset", "agent"):
            return
        require(
            bool(self.train_files),
            "data.train_files",
            f"task.name is {task_name} but no training file is given",
            "set data.train_files=path/to/train.jsonl",
        )
        require(
            val_every == 0 or bool(self.val_files),
            "data.val_files",
            "trainer.val_every > 0 needs a validation set",
            "set data.val_files=path/to/val.jsonl, or trainer.val_every=0",
        )
        if model.path is None:
            need = self.max_prompt_length + self.max_response_length
            require(
                need <= model.n_positions,
                "data.max_prompt_length",
                f"max_prompt_length + max_response_length = {need} > model.n_positions ({model.n_positions})",
                "lower data.max_prompt_length / data.max_response_length or raise model.n_positions",
            )
