"""``psrl`` command line: ``train``, ``simulate``, ``viz``, ``profile``, ``config``.

Each sub-command lives in its own layer and is imported only when used, so ``psrl --help``
starts fast and the core never pulls torch in.
"""

from __future__ import annotations

import importlib
import os
import sys

COMMANDS = {
    "train": ("psrl.train_cli", "Run asynchronous RL training (built-in agentic task by default)."),
    "simulate": ("psrl.sim.cli", "Simulate throughput, staleness and waste of a workload; compare staleness policies."),
    "viz": ("psrl.viz.cli", "Draw the buffer timeline of a run directory (reserve / occupy / consume)."),
    "profile": ("psrl.runtime.profile", "Fit the throughput_optimal router's cost model from a short profiling run."),
    "config": (
        "psrl.config_cli",
        "Print the resolved configuration (defaults + file + overrides), or the key reference.",
    ),
}

USAGE = (
    """psrl [--debug] <command> [CONFIG] [key=value ...]

Asynchronous RL post-training with fine-grained, provable staleness control.

commands:
"""
    + "\n".join(f"  {name:<10} {help}" for name, (_, help) in COMMANDS.items())
    + """

Dotted overrides set any configuration key, e.g. `psrl train psrl.staleness=2 trainer.total_steps=10`.
`psrl <command> --help` shows the options of one command. Errors print as one line naming the key or
the file that caused them; `psrl --debug <command>` (or PSRL_DEBUG=1) shows the traceback instead."""
)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "--debug":
        os.environ["PSRL_DEBUG"] = "1"  # the commands' one_line_errors re-raise with the traceback
        argv = argv[1:]
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    if argv[0] == "--version":
        from psrl import __version__

        print(__version__)
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"psrl: unknown command '{name}'; choose from {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    from psrl.errors import one_line_errors

    try:
        module = importlib.import_module(COMMANDS[name][0])
        return int(one_line_errors(f"psrl {name}")(module.main)(rest) or 0)
    except KeyboardInterrupt:
        print(
            f"\npsrl {name}: interrupted; the run directory is resumable (same command continues it)", file=sys.stderr
        )
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
