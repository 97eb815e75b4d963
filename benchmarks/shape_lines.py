"""How many lines of src/ issue #21 (the shape issue: config package, rollout rooms, typed seams, visible wires,
one name per concept, twins, ruff + mypy) moved, added and removed, against the Protocols it added.

Its acceptance asks: "Net lines in src/ do not grow by more than the Protocols added (say how many lines moved,
were removed, added)". Other issues landed in between, so the count is over #21's own commits (listed below by
item; its merges resolved with 0 to -4 lines each, left out), ``.py`` files under ``src/`` only:

* net physical lines, and net *logical* lines (Python statements: ``tokenize`` NEWLINE tokens, so blank lines,
  comments, wrapping and the formatter's layout do not count);
* moved / added / removed: git's own moved-line detection (``--color-moved=plain``, indentation changes allowed);
* the Protocols: classes with a ``Protocol`` base, first to last line, new or grown between ``BASE`` (the commit
  before the first move) and ``SHAPE_END`` (#21's last commit before the trainer issue landed).

Run from a clone with its history: ``python benchmarks/shape_lines.py`` (about a minute). Ends with one JSON line.
"""

from __future__ import annotations

import ast
import io
import json
import subprocess
import sys
import tempfile
import tokenize
from pathlib import Path

BASE = "00c772a"
SHAPE_END = "7579cba"
ITEMS = {
    "2: rooms (moves, fakes, __init__ APIs, splits under the line limit)": "acc0804 6fec81c 22ab4b7 b0dbf9d 2e669ad "
    "142649e 5282265 2d30073",
    "1: config package (+ the task/data split)": "7ec76db 6ea0c2f",
    "3-4: seams and wires (Protocols, build_rollout, status(), ctor args)": "f9f8574 c039f0a 8cedc03 ace55d3 15dc7ae "
    "523cbb4",
    "5: names (EventKind, occupy, SnapshotEntry, state_dict verbs, metric table)": "91dfc9d 7b582bd 6ad2ba3 dcc2b5d",
    "6: twins": "ac6a49b 479a3d2 f12f665 95d9932 94c72c9",
    "7: ruff lint": "ae46ce6",
    "7: ruff format": "8b8fe0d",
    "7: mypy clean (named errors, declared types)": "d8b03f4 fac9eb1 fd870ec 7adae27 130b72a f9d31b2 8d51010 ee2ca95 "
    "32ac1d1 4aece4f 54780f5",
    "trims (branch trim21, one reader)": "0d0c28a 749ac82 27d5896 a49f2c8 92039ae c9eb644 7326ebb",
    "trims (stop 31)": "4e9b6fe 4b166c4 1fa9a45 6383f1b 284aa9d 4d31285 81cb63b f9ede23 192afa5 b5c09f3 d98becf "
    "def26f6 7f72904 22b10f9 4c1a71b 2049fa7 94dc4cc 6e3e1db 861c82b 9d9f488 0c0231d 38f7f43",
}
FORMATTER = "7: ruff format"


def git(*args: str) -> str:
    return subprocess.run(["git", *args], capture_output=True, text=True, check=True).stdout


def source(rev: str, path: str) -> str | None:
    done = subprocess.run(["git", "show", f"{rev}:{path}"], capture_output=True, text=True)
    return done.stdout if done.returncode == 0 else None


def logical(text: str) -> int:
    return sum(t.type == tokenize.NEWLINE for t in tokenize.generate_tokens(io.StringIO(text).readline))


def net(parent: str, commit: str) -> tuple[int, int]:
    """(physical, logical) lines the commit adds to src/**/*.py, net."""
    phys = stmts = 0
    for path in git("diff", "--name-only", "--no-renames", parent, commit, "--", "src").split():
        if path.endswith(".py"):
            for rev, sign in ((commit, 1), (parent, -1)):
                text = source(rev, path)
                if text is not None:
                    phys += sign * len(text.splitlines())
                    stmts += sign * logical(text)
    return phys, stmts


MOVED_OLD, ADDED, REMOVED = "\x1b[34m-", "\x1b[32m+", "\x1b[31m-"


def moved_added_removed(commit: str) -> tuple[int, int, int]:
    """Lines git sees moved (counted once, on the old side), added and removed (not moved)."""
    colours = ["color.diff.oldMoved=blue", "color.diff.newMoved=yellow", "color.diff.old=red", "color.diff.new=green"]
    args = [a for c in colours for a in ("-c", c)]
    diff = git(
        *args,
        "show",
        "--format=",
        "--no-renames",
        "--color=always",
        "--color-moved=plain",
        "--color-moved-ws=allow-indentation-change",
        commit,
        "--",
        "src",
    )
    lines = diff.splitlines()
    moved, added, removed = (sum(ln.startswith(p) for ln in lines) for p in (MOVED_OLD, ADDED, REMOVED))
    return moved, added, removed


def protocols(rev: str) -> dict[str, int]:
    """{class name: lines} of every Protocol class under src/ at ``rev``."""
    out = {}
    for path in git("ls-tree", "-r", "--name-only", rev, "src").split():
        if path.endswith(".py"):
            for node in ast.walk(ast.parse(source(rev, path) or "")):
                if isinstance(node, ast.ClassDef) and any(
                    getattr(b, "id", getattr(b, "attr", None)) == "Protocol" for b in node.bases
                ):
                    out[node.name] = (node.end_lineno or node.lineno) - node.lineno + 1
    return out


def formatter_on_base() -> tuple[int, int]:
    """src/ lines at BASE as committed, and after ``ruff format`` with today's settings."""
    with tempfile.TemporaryDirectory() as tmp:
        archive = subprocess.run(["git", "archive", BASE, "src"], capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        files = sorted(Path(tmp).rglob("*.py"))
        before = sum(len(p.read_text().splitlines()) for p in files)
        config = Path("pyproject.toml").resolve()
        subprocess.run([sys.executable, "-m", "ruff", "format", "-q", "--config", str(config), tmp], check=True)
        return before, sum(len(p.read_text().splitlines()) for p in files)


def main() -> None:
    rows = {}
    for item, commits in ITEMS.items():
        total = [0, 0, 0, 0, 0]
        for c in commits.split():
            parent = git("rev-parse", f"{c}^").strip()
            for i, v in enumerate((*net(parent, c), *moved_added_removed(c))):
                total[i] += v
        rows[item] = total
    print(f"{'#21 item':<78} {'physical':>9} {'logical':>8} {'moved':>6} {'added':>6} {'removed':>7}")
    for item, (p, lg, m, a, r) in rows.items():
        print(f"{item:<78} {p:>+9} {lg:>+8} {m:>6} {a:>6} {r:>7}")
    total = [sum(v[i] for v in rows.values()) for i in range(5)]
    no_fmt = [t - f for t, f in zip(total, rows[FORMATTER])]
    print(f"{'total':<78} {total[0]:>+9} {total[1]:>+8} {total[2]:>6} {total[3]:>6} {total[4]:>7}")
    print(
        f"{'total without the formatter':<78} {no_fmt[0]:>+9} {no_fmt[1]:>+8} {no_fmt[2]:>6} {no_fmt[3]:>6}"
        f" {no_fmt[4]:>7}"
    )
    old, new = protocols(BASE), protocols(SHAPE_END)
    grown = {name: n - old.get(name, 0) for name, n in new.items() if n != old.get(name, 0)}
    allowance = sum(grown.values())
    print(f"Protocols #21 added ({BASE} -> {SHAPE_END}): {allowance} lines: {grown}")
    before, formatted = formatter_on_base()
    print(f"ruff format on {BASE}'s own src/: {before} -> {formatted} lines ({formatted - before:+})")
    met = no_fmt[0] <= allowance
    print(f"net lines without the formatter {no_fmt[0]:+} vs Protocols {allowance}: {'met' if met else 'NOT met'}")
    print(
        json.dumps(
            {
                "items": {
                    k: dict(zip(("physical", "logical", "moved", "added", "removed"), v)) for k, v in rows.items()
                },
                "net_physical": total[0],
                "net_physical_without_formatter": no_fmt[0],
                "net_logical": total[1],
                "moved": total[2],
                "added": total[3],
                "removed": total[4],
                "protocol_lines": allowance,
                "formatter_on_base": formatted - before,
                "met": met,
            }
        )
    )


if __name__ == "__main__":
    main()
