"""psrl's own errors: what the command line reports as one line instead of a traceback.

Two kinds, one base class:

* :class:`ConfigError` -- a configuration value is wrong; raised at load, before anything is
  written or started, and names the dotted key, the problem and the fix.
* :class:`RunError` -- something that can only go wrong once the run is going (a dataset row, a
  reward function, a rollout engine, a damaged run directory or checkpoint); it names what caused
  it (a file and line, a trajectory, an engine) so the user knows where to look.

``psrl <command>`` prints any :class:`PsrlError` as one line and exits non-zero; ``psrl --debug
<command>`` or ``PSRL_DEBUG=1`` shows the traceback instead (see :mod:`psrl.cli`). Stdlib only:
every layer may raise these.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "PsrlError",
    "ConfigError",
    "RunError",
    "debug_enabled",
    "describe",
    "one_line_errors",
    "resolve_target",
]


class PsrlError(Exception):
    """Base of the errors psrl reports as one line (exit status :attr:`exit_code`)."""

    exit_code = 1


class ConfigError(PsrlError, ValueError):
    """A configuration value is wrong. The message names the dotted key and how to fix it."""

    exit_code = 2

    def __init__(self, key: str, problem: str, fix: str = ""):
        self.key, self.problem, self.fix = key, problem, fix
        super().__init__(_one_line(f"config key '{key}': {problem}" + (f" -- fix: {fix}" if fix else "")))

    def __reduce__(self):  # picklable across Ray processes despite the 3-argument constructor
        return (type(self), (self.key, self.problem, self.fix))


class RunError(PsrlError):
    """A failure during a run, attributed to ``source`` (a file:line, a trajectory, an engine)."""

    def __init__(self, source: str, problem: str, fix: str = ""):
        self.source, self.problem, self.fix = source, problem, fix
        super().__init__(_one_line(f"{source}: {problem}" + (f" -- fix: {fix}" if fix else "")))

    def __reduce__(self):
        return (type(self), (self.source, self.problem, self.fix))


def _one_line(msg: str) -> str:
    """Line breaks a user's key or value brought in are shown escaped: the message stays one line."""
    return msg.replace("\r", "\\r").replace("\n", "\\n")


def debug_enabled() -> bool:
    """``PSRL_DEBUG`` set to anything but empty or 0 (``psrl --debug`` sets it): show tracebacks."""
    import os

    return os.environ.get("PSRL_DEBUG", "") not in ("", "0")


def describe(exc: BaseException) -> str:
    """One line for an exception psrl did not anticipate: its type, message and the innermost frame that
    raised it (file:line in function), so a user knows whether their reward function, dataset or psrl failed."""
    import traceback

    frames = traceback.extract_tb(exc.__traceback__) if exc.__traceback__ else []
    where = f" (at {frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name})" if frames else ""
    lines = str(exc).strip().splitlines() or [""]
    text = lines[0][:300] + (" ..." if len(lines) > 1 or len(lines[0]) > 300 else "")
    return f"{type(exc).__name__}{': ' + text if text else ''}{where}"


def one_line_errors(prog: str):
    """Decorate a command's ``main(argv) -> int``: a :class:`PsrlError` prints as one line on stderr and
    returns its exit status; any other exception prints as one line naming where it was raised and
    returns 1. With :func:`debug_enabled` the exception propagates, traceback and all."""
    import functools
    import sys

    def wrap(main):
        @functools.wraps(main)
        def run(*args, **kwargs):
            try:
                return main(*args, **kwargs)
            except PsrlError as exc:
                if debug_enabled():
                    raise
                print(f"{prog}: {exc}", file=sys.stderr)
                return exc.exit_code
            except Exception as exc:
                if debug_enabled():
                    raise
                print(
                    f"{prog}: unexpected error: {describe(exc)}; run `psrl --debug {prog.split()[-1]} ...` or set "
                    "PSRL_DEBUG=1 for the traceback",
                    file=sys.stderr,
                )
                return 1

        return run

    return wrap


def resolve_target(key: str, spec: str, kind: str = "callable") -> Any:
    """Import ``module:attr`` (attr may be dotted) at load; a ConfigError naming ``key`` when it cannot be."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ConfigError(
            key,
            f"{spec!r} is not module:{'Class' if kind == 'class' else 'function'}",
            "write it as package.module:Name",
        )
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as e:  # ImportError, or the module itself failing at import time
        raise ConfigError(
            key,
            f"cannot import module {module_name!r} ({type(e).__name__}: {e})",
            "give an importable module (on PYTHONPATH) before the ':'",
        ) from e
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(key, f"module {module_name!r} has no attribute {attr!r}", "check the name after ':'")
        obj = getattr(obj, part)
    if kind == "class" and not isinstance(obj, type):
        raise ConfigError(key, f"{spec!r} is not a class", "point it at a class")
    if not callable(obj):
        raise ConfigError(key, f"{spec!r} is not callable", "point it at a function or class")
    return obj
