"""Every table of measured numbers in ``docs/`` is what ``benchmarks/render_docs.py`` makes of the stored results
(``docs/results/``): a table edited by hand, or results stored without rendering the docs again, fail here."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
from render_docs import BLOCK, RENDERERS, render  # noqa: E402

DOCS = sorted((ROOT / "docs").glob("*.md"))


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_the_docs_tables_are_the_rendered_stored_results(doc):
    text = doc.read_text()
    blocks = list(BLOCK.finditer(text))
    assert len(re.findall("<!-- results:", text)) == len(re.findall("<!-- /results:", text)) == len(blocks)
    for mine, made in zip(blocks, BLOCK.finditer(render(text))):
        assert mine["body"] == made["body"], f"{doc.name}: {mine['name']} differs; run benchmarks/render_docs.py"


def test_every_renderer_has_its_block_and_every_stored_result_its_command():
    used = {m["name"] for doc in DOCS for m in BLOCK.finditer(doc.read_text())}
    assert used == set(RENDERERS)
    for path in sorted((ROOT / "docs" / "results").glob("*.json")):
        assert json.loads(path.read_text())["command"].startswith("PYTHONPATH=src python benchmarks/"), path.name
