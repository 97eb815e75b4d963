"""``psrl`` command line: ``train``, ``simulate``, ``viz``, ``config``.

Each sub-command lives in its own layer and is imported only when used, so ``psrl --help``
starts fast and the core never pulls torch in.
"""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "train": ("psrl.train_cli", "Run asynchronous RL training (built-in agentic task by default)."),
    "simulate": ("psrl.sim.cli", "Simulate throughput, staleness and waste of a workload; compare staleness policies."),
    "viz": ("psrl.viz.cli", "Draw the buffer timeline of a run directory (reserve / occupy / consume)."),
    "config": ("psrl.config_cli", "Print the resolved configuration (defaults + file + overrides), or the key reference."),
}

USAGE = """psrl <command> [CONFIG] [key=value ...]

Asynchronous RL post-training with fine-grained, provable staleness control.

commands:
""" + "\n".join(f"  {name:<10} {help}" for name, (_, help) in COMMANDS.items()) + """

Dotted overrides set any configuration key, e.g. `psrl train psrl.staleness=2 trainer.total_steps=10`.
`psrl <command> --help` shows the options of one command."""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
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
    module = importlib.import_module(COMMANDS[name][0])
    from psrl.config import ConfigError

    try:
        return int(module.main(rest) or 0)
    except ConfigError as exc:
        print(f"psrl {name}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"\npsrl {name}: interrupted; the run directory is resumable (same command continues it)", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
