"""README.md, the front door (issue #34): its sections, its size limits, and the commands, paths and example it holds.

The limits, defined precisely:

* A **code block** runs from a line starting with three backticks to the next such line, both fences included.
  Code blocks are exempt from both limits and separate paragraphs as a blank line does.
* A **paragraph** is a run of consecutive non-blank lines outside code blocks, cut again before every line that
  starts a block of its own: a heading (``#``), a list item (``- ``, ``* ``, ``1. ``), a table row (``|``), an
  HTML comment (``<!--``) or an image (``![``). So each list item (with its continuation lines) and each table
  row is a paragraph of its own. No paragraph has more than 6 lines.
* A **line** is measured in characters, without its newline. No line outside code blocks has more than 120.
"""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

import pytest

from psrl.config import load_config

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
MAX_PARAGRAPH_LINES = 6
MAX_LINE_CHARS = 120

SECTIONS = [
    "Quick start",
    "What a run writes",
    "The knobs people turn first",
    "Your data, your reward, your agent",
    "Engines and scaling out",
    "Simulate and recommend",
    "Embed the core",
    "Development",
    "Map of `docs/`",
]
"""The README's ``##`` sections, in order (issue #34, item 4); what psrl is comes first, under the title."""

SETUP = "python3 -m venv .venv && .venv/bin/pip install -e '.[dev]' && .venv/bin/psrl train"
TEST = ".venv/bin/python -m pytest"
"""The two commands of the quick start, verbatim: CI runs the test command as the README gives it."""

_OWN_BLOCK = re.compile(r"^(#|- |\* |\d+\. |\||<!--|!\[)")


def prose_lines(text: str) -> list[tuple[int, str]]:
    """``(line number, line)`` of every line, with the lines of code blocks (fences included) blanked."""
    out, in_code = [], False
    for i, line in enumerate(text.splitlines(), 1):
        fence = line.startswith("```")
        out.append((i, "" if in_code or fence else line))
        if fence:
            in_code = not in_code
    return out


def paragraphs(text: str) -> list[list[tuple[int, str]]]:
    """The paragraphs of ``text`` as the module docstring defines them."""
    paras: list[list[tuple[int, str]]] = []
    current: list[tuple[int, str]] = []
    for i, line in prose_lines(text):
        if not line.strip() or _OWN_BLOCK.match(line):
            if current:
                paras.append(current)
            current = [(i, line)] if line.strip() else []
        else:
            current.append((i, line))
    if current:
        paras.append(current)
    return paras


def code_blocks(text: str) -> list[tuple[str, list[str]]]:
    """``(info string, lines)`` of every fenced code block."""
    blocks, lines = [], text.splitlines()
    i = 0
    while i < len(lines):
        if lines[i].startswith("```"):
            j = next(k for k in range(i + 1, len(lines)) if lines[k].startswith("```"))
            blocks.append((lines[i][3:].strip(), lines[i + 1 : j]))
            i = j
        i += 1
    return blocks


def test_paragraphs_are_cut_at_blank_lines_code_blocks_list_items_and_table_rows():
    """The definition the limits use, on a sample: what counts as one paragraph and what splits them."""
    sample = "\n".join(
        ["# Title", "one", "two", "", "three", "```", "code", "```", "four", "- item", "  more", "| a |", "| b |", "x"]
    )
    got = [[line for _, line in p] for p in paragraphs(sample)]
    assert got == [["# Title", "one", "two"], ["three"], ["four"], ["- item", "  more"], ["| a |"], ["| b |", "x"]]
    assert max(len(p) for p in paragraphs("\n".join(["word"] * 7))) == 7  # seven lines are one paragraph, over


def test_no_paragraph_over_six_lines():
    long = [(p[0][0], len(p)) for p in paragraphs(README) if len(p) > MAX_PARAGRAPH_LINES]
    assert not long, f"(first line, lines) of paragraphs over {MAX_PARAGRAPH_LINES} lines: {long}"


def test_no_line_over_120_characters_outside_code_blocks():
    wide = [(i, len(line)) for i, line in prose_lines(README) if len(line) > MAX_LINE_CHARS]
    assert not wide, f"(line, characters) over {MAX_LINE_CHARS}: {wide}"


def test_sections_in_order_after_what_psrl_is():
    """The title, then what psrl is (the guarantee and the timeline picture), then the sections of issue #34."""
    headings = [line[3:] for _, line in prose_lines(README) if line.startswith("## ")]
    assert headings == SECTIONS
    intro = README.split("\n## ", 1)[0]
    assert intro.startswith("# psrl\n") and "consumed_version - V_traj <= psrl.staleness" in intro
    picture = re.search(r"!\[[^\]]+\]\(([^)]+)\)", intro)
    assert picture and (ROOT / picture.group(1)).is_file()


def test_quick_start_commands_are_verbatim():
    quick = dict(code_blocks(README.split("## Quick start", 1)[1])[:1])["bash"]
    assert SETUP in quick and TEST in quick


def test_every_path_it_names_exists():
    """Files and directories of this repository that the README names (docs pages, scripts, modules, tests)."""
    named = set(re.findall(r"(?<![\w/.])((?:docs|src|tests|benchmarks|examples)/[\w./-]*[\w/])", README))
    assert len(named) >= 20  # the finder finds what the README names
    missing = sorted(p for p in named if not (ROOT / p).exists())
    assert not missing


def test_the_docs_map_lists_every_page_once():
    docs_map = README.split("## Map of `docs/`", 1)[1]
    listed = re.findall(r"^\| `(docs/[^`]+)` \|", docs_map, re.M)
    assert sorted(listed) == sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))


VALUE_OPTIONS = {"--sweep", "--recommend", "--out", "--policies", "--plot", "--max-staleness", "--max-discard"}
"""``psrl simulate`` options whose value is the next word (a ``--sweep k=v1,v2`` is checked value by value)."""


def commands(text: str) -> list[list[str]]:
    """The words of every ``psrl train|simulate|config`` command in the README: in code blocks and in inline
    code, split at ``&&``, comments dropped, starting at the sub-command."""
    candidates = [line for _, lines in code_blocks(text) for line in lines]
    candidates += re.findall(r"`([^`\n]*psrl (?:train|simulate|config)[^`\n]*)`", text)
    out = []
    for line in candidates:
        all_words = shlex.split(line, comments=True)
        cuts = [-1] + [i for i, w in enumerate(all_words) if w == "&&"] + [len(all_words)]
        for a, b in zip(cuts, cuts[1:]):
            words = all_words[a + 1 : b]
            at = next((i for i, w in enumerate(words) if w.endswith("psrl") and i + 1 < len(words)), None)
            if at is not None and words[at + 1] in ("train", "simulate", "config"):
                out.append(words[at + 1 :])
    return out


def test_every_command_it_gives_loads(tmp_path, monkeypatch):
    """Each ``psrl`` command's overrides are keys that validate together, as ``psrl train`` checks them before
    anything starts. The agent example's ``my_agent:MyAgent`` is provided here as a module on the path."""
    (tmp_path / "my_agent.py").write_text("from psrl.tasks.tool_arith import ToolArithTask as MyAgent\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    found = commands(README)
    assert sum(c[0] == "train" for c in found) >= 6 and sum(c[0] == "simulate" for c in found) >= 4
    for words in found:
        overrides, sweeps = [], []
        for prev, w in zip([""] + words, words):
            if prev == "--sweep":
                key, values = w.split("=", 1)
                sweeps += [f"{key}={v}" for v in values.split(",")]
            elif "=" in w and prev not in VALUE_OPTIONS and not w.startswith("-"):
                overrides.append(w)
        for extra in sweeps or [None]:
            load_config(None, overrides + ([extra] if extra else []))


def test_the_core_snippet_runs():
    """The ``python`` block is what it says: two completions fill the reserved group and occupy buffer 0."""
    (snippet,) = [lines for info, lines in code_blocks(README) if info == "python"]
    scope: dict = {}
    exec("\n".join(snippet), scope)  # noqa: S102 -- the README's own example, run as a reader would paste it
    assert scope["m"].counts(0) == (0, 1, 3)  # (reserved, occupied, empty) of buffer 0: the group landed there


def _example_script():
    """``benchmarks/readme_example.py`` as a module (benchmarks/ is a folder of scripts, not a package)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import readme_example
    finally:
        sys.path.pop(0)
    return readme_example


def test_the_example_output_is_the_default_commands():
    """The example block is ``psrl train``'s own output (``benchmarks/readme_example.py`` writes it): it ends with
    the run's last line, whose steps and bound are the preset's, and the script's reader and writer agree on it."""
    readme_example = _example_script()
    lines = readme_example.read_example(README)
    done = readme_example.parse_done(lines[-1])
    preset = load_config(None)
    assert (done["steps"], done["bound"]) == (preset.trainer.total_steps, preset.psrl.staleness)
    assert done["max_staleness"] <= done["bound"] and preset.trainer.seed == 0
    assert readme_example.replace_example(README, lines) == README
    assert lines[-2].startswith(f"step {done['steps']:3d}/{done['steps']} ")


@pytest.mark.slow
def test_the_example_script_rewrites_the_block_and_the_picture_from_a_run(tmp_path):
    """``benchmarks/readme_example.py`` on a tiny run (its overrides): the block becomes that run's output, the
    rest of the README is untouched, the picture is the run's timeline, and the JSON line is the run's last line."""
    from tests.benchmarks.run import run_benchmark

    readme, image = tmp_path / "README.md", tmp_path / "timeline.png"
    readme.write_text(README)
    tiny = ["model.n_layer=1", "model.n_embd=32", "model.n_head=2", "trainer.warm_start_steps=5"]
    tiny += ["trainer.total_steps=3", "psrl.staleness_buffer_entries=2", "psrl.rollout_n=2"]
    last = run_benchmark("readme_example.py", "--readme", str(readme), "--image", str(image), *tiny)
    assert (last["steps"], last["bound"]) == (3, 2) and last["max_staleness"] <= 2
    text = readme.read_text()
    readme_example = _example_script()
    lines = readme_example.read_example(text)
    assert readme_example.parse_done(lines[-1])["steps"] == 3 and lines[-2].startswith("step   3/3 ")
    assert text.split(readme_example.BEGIN)[0] == README.split(readme_example.BEGIN)[0]
    assert text.split(readme_example.END)[1] == README.split(readme_example.END)[1]
    assert image.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
