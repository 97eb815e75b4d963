"""The core imports with the standard library only: torch, ray, numpy and yaml blocked."""

from __future__ import annotations

import subprocess
import sys

BLOCKER = r"""
import sys, importlib.abc
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split('.')[0] in {'torch', 'ray', 'numpy', 'yaml', 'transformers'}:
            raise ImportError('blocked: ' + name)
        return None
sys.meta_path.insert(0, Block())
import psrl.staleness as s
m = s.StalenessManager(staleness=1, batch_size=1, group_size=1)
e = m.try_reserve(0); m.complete(e, 'x', 0); m.consume()
mods = {n.split('.')[0] for n in sys.modules}
assert not mods & {'torch', 'ray', 'numpy', 'yaml', 'transformers'}, mods
print('ok')
"""


def test_core_imports_with_heavy_packages_blocked():
    out = subprocess.run([sys.executable, "-c", BLOCKER], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
