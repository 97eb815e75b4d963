"""Watching a run: the console (a progress bar on a terminal, plain lines otherwise), TensorBoard and
wandb (``trainer.logger``), and validation every ``trainer.val_every`` steps.

``metrics.jsonl`` is written by the :class:`~psrl.runtime.recorder.RunRecorder` whatever the
loggers are (resume and the simulator's replay read it); the trackers get the same rows, with
the same names (:mod:`psrl.metrics`), numbers only. wandb runs offline (no network) unless
``WANDB_MODE`` says otherwise; its files go to ``RUN_DIR/wandb``, TensorBoard's to
``RUN_DIR/tensorboard``. Both are optional: ``pip install -e ".[track]"``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from psrl.runtime.validate import ValidationEngines

__all__ = ["Trackers", "RunWatch", "scalars"]


def scalars(row: dict) -> dict[str, float]:
    """The numeric entries of a metrics row (buffer states and instance lists are not scalars)."""
    return {k: float(v) for k, v in row.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


class Trackers:
    """TensorBoard and/or wandb, fed the rows written to ``metrics.jsonl``."""

    def __init__(self, cfg: Any, run_dir: Path, resume_version: int = 0):
        names = set(cfg.trainer.logger)
        self.tb = self.wandb = None
        if "tensorboard" in names:
            from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package ([track])

            # a resumed run rewrites the steps after its checkpoint: drop TensorBoard's copies of them
            self.tb = SummaryWriter(
                str(run_dir / "tensorboard"), purge_step=resume_version + 1 if resume_version else None
            )
        if "wandb" in names:
            import wandb  # [track]

            from psrl.config import config_to_dict

            self.wandb = wandb.init(
                project=cfg.trainer.project_name,
                name=cfg.trainer.experiment_name or run_dir.name,
                dir=str(run_dir),
                mode=os.environ.get("WANDB_MODE", "offline"),
                config=config_to_dict(cfg),
                settings=wandb.Settings(console="off", silent=True),
            )

    def log(self, row: dict) -> None:
        step = int(row.get("step", 0))
        values = scalars({k: v for k, v in row.items() if k != "step"})
        if self.tb is not None:
            for k, v in values.items():
                self.tb.add_scalar(k, v, step)
            self.tb.flush()
        if self.wandb is not None:
            self.wandb.log(values, step=step)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


class _Bar:
    """A tqdm bar with ETA over the steps (terminals only)."""

    def __init__(self, total: int, done: int):
        from tqdm import tqdm

        self.bar = tqdm(total=total, initial=done, unit="step", dynamic_ncols=True, file=sys.stdout)

    def step(self, row: dict) -> None:
        self.bar.update(int(row["step"]) - self.bar.n)
        self.bar.set_postfix_str(
            f"reward {row['reward/mean']:.3f} staleness {row['staleness/mean']:.2f}/{row['staleness/max']}",
            refresh=True,
        )

    def close(self) -> None:
        self.bar.close()


class RunWatch:
    """What ``psrl train`` does after each step besides checkpointing: show it, track it, validate.

    Args:
        cfg: the config (``trainer.logger``, ``trainer.val_every``, ``trainer.val_n``, ...).
        run_dir: the run directory.
        coord: the coordinator (its task gives the validation set).
        recorder: where validation rows go (``metrics.jsonl``), next to the step rows; the trackers get both.
        log: the plain-line sink (console without a terminal).
        line: formats one step row as a plain line.
        tty: whether stdout is a terminal (default: ask it).
        validator: the validation instances (:class:`~psrl.runtime.validate.ValidationEngines`, which load the
            newest published version); None: no validation (``trainer.val_every=0``).
    """

    def __init__(
        self,
        cfg: Any,
        run_dir: Path,
        coord: Any,
        recorder: Any,
        log: Callable[[str], None],
        line: Callable[[dict, int], str],
        tty: bool | None = None,
        validator: ValidationEngines | None = None,
    ):
        self.cfg, self.coord, self.recorder, self.log, self.line = cfg, coord, recorder, log, line
        self.validator = validator
        self.total = cfg.trainer.total_steps
        self.console = "console" in cfg.trainer.logger
        tty = sys.stdout.isatty() if tty is None else tty
        self._val_prompts: list | None = None
        if validator is not None and cfg.trainer.val_every > 0:  # read now: a bad validation set stops the run
            self._val_prompts = coord.agents.task.val_prompts(cfg.trainer.val_size)  # before its first step
        self.bar = _Bar(self.total, coord.version) if self.console and tty else None
        self.trackers = Trackers(cfg, Path(run_dir), resume_version=coord.version)
        dropped = getattr(coord.agents.task, "dropped", 0) if hasattr(coord, "agents") else 0
        if dropped:
            log(f"data: dropped {dropped} prompts longer than data.max_prompt_length (data.filter_overlong_prompts)")

    def after_step(self, row: dict) -> None:
        """Show and track the step; validate when ``trainer.val_every`` says so (and after the last step)."""
        self.trackers.log(row)
        if self.bar is not None:
            self.bar.step(row)
        elif self.console:
            self.log(self.line(row, self.total))
        every, step = self.cfg.trainer.val_every, int(row["step"])
        if self.validator is not None and every > 0 and (step % every == 0 or step >= self.total):
            self.validate(row)

    def validate(self, row: dict) -> dict:
        """Validate the newest published version on the validation engines; the row (with ``step``, ``version``)
        goes to metrics.jsonl."""
        assert self.validator is not None, "RunWatch.validate needs the validation engines"
        t = self.cfg.trainer
        task = self.coord.agents.task
        if self._val_prompts is None:
            self._val_prompts = task.val_prompts(t.val_size)
        metrics = self.validator.validate(task, self._val_prompts, t.val_n, t.temperature, t.top_p, seed=t.seed)
        version = int(metrics.pop("version"))
        out = {"step": int(row["step"]), "version": version, "val/time": row.get("time", 0.0), **metrics}
        self.recorder.metric(out)
        self.trackers.log(out)
        if self.console:
            msg = (
                f"validation at step {out['step']} (v{out['version']}): accuracy {out['val/accuracy']:.3f} "
                f"reward {out['val/reward']:.3f} pass@{t.val_n} {out['val/pass@k']:.3f} "
                f"on {len(self._val_prompts)} prompts ({out['val/seconds']:.1f}s)"
            )
            if self.bar is not None:
                self.bar.bar.write(msg)
            else:
                self.log(msg)
        return out

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        self.trackers.close()
