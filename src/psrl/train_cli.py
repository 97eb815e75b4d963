"""``psrl train [CONFIG] [key=value ...]``: asynchronous RL training with staleness control.

With no arguments it trains the built-in agentic task (``tool_arith``: a calculator tool with
heavy-tailed latency) on the tiny built-in model, asynchronously, in a few minutes on a
laptop CPU, and writes ``runs/<timestamp>/``. ``CONFIG`` is a YAML file with ``psrl:``,
``algorithm:``, ``model:``, ``task:``, ``trainer:`` sections; dotted ``key=value`` overrides
follow it (``psrl.staleness=0`` trains synchronously). Ctrl-C or SIGTERM leaves a resumable run: run the
same command with ``trainer.run_dir=<that dir>`` to continue.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from psrl.errors import one_line_errors

__all__ = ["main", "prepare"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="psrl train",
        description="Asynchronous RL post-training with fine-grained staleness control.",
        epilog="examples: psrl train | psrl train psrl.staleness=0 | psrl train cfg.yaml trainer.total_steps=10 "
        "trainer.run_dir=runs/a",
    )
    p.add_argument(
        "args",
        nargs="*",
        metavar="[CONFIG] [key=value ...]",
        help="an optional YAML config file, then dotted overrides (see docs/configuration.md)",
    )
    return p


def prepare(args: list[str]) -> tuple[Any, Path]:
    """``(config, run directory)`` of ``psrl train [CONFIG] [key=value ...]``: everything that is checked
    before anything is written or started. A :class:`~psrl.errors.ConfigError` names the key."""
    from psrl.config import check_out_dir, load_config
    from psrl.runtime.recorder import default_run_dir

    args = list(args)
    path = args.pop(0) if args and "=" not in args[0] else None
    cfg = load_config(path, args)
    run_dir = Path(cfg.trainer.run_dir) if cfg.trainer.run_dir else default_run_dir()
    check_out_dir("trainer.run_dir", run_dir)  # the default runs/<time> too
    check_environment(cfg)
    return cfg, run_dir


def check_environment(cfg: Any) -> None:
    """What the config asks of this machine: a CUDA device, the ray package."""
    import importlib.util

    from psrl.config import ConfigError

    if cfg.runtime.backend == "ray" and importlib.util.find_spec("ray") is None:
        raise ConfigError(
            "runtime.backend",
            "is ray, but the ray package is not installed",
            "pip install 'psrl[ray]', or set runtime.backend=local",
        )
    if cfg.model.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ConfigError(
                "model.device",
                "is cuda, but torch sees no CUDA device here",
                "set model.device=auto (CUDA when present, else CPU) or model.device=cpu",
            )


@one_line_errors("psrl train")
def main(argv: list[str] | None = None) -> int:
    """Parse, load and validate the config, train; 0 on success, 2 on a config error, 1 on an error during
    the run (one line; ``PSRL_DEBUG=1`` for the traceback), 130 on Ctrl-C, 143 on SIGTERM (both leave a
    resumable run)."""
    ns = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    cfg, run_dir = prepare(ns.args)
    from psrl.heap import return_freed_memory

    return_freed_memory()  # a CPU trainer's heap otherwise grows with every step (psrl/heap.py)
    import torch

    torch.set_num_threads(1)
    from psrl.config import ConfigError
    from psrl.runtime.local import Terminated, run
    from psrl.tasks.dataset import DataError

    try:
        run(cfg, run_dir, log=_log)
    except (ConfigError, DataError) as e:  # found while building: a missing file, a bad row, a bad reward
        print(f"psrl train: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM (Terminated is a KeyboardInterrupt)
        what, code = ("terminated", 143) if isinstance(exc, Terminated) else ("interrupted", 130)
        args = [a for a in ns.args if not a.startswith("trainer.run_dir=")]  # said once, as the resolved path
        print(
            f"\n{what}; resume with: psrl train {' '.join(args)} trainer.run_dir={run_dir}".replace("  ", " "),
            file=sys.stderr,
        )
        return code
    return 0


def _log(line: str) -> None:
    print(line, flush=True)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
