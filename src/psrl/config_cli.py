"""``psrl config [CONFIG] [key=value ...] [--reference]``: show what a run would use."""

from __future__ import annotations

import argparse

from psrl.config import config_to_dict, load_config, reference_markdown
from psrl.errors import one_line_errors


@one_line_errors("psrl config")
def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="psrl config", description=__doc__)
    ap.add_argument("args", nargs="*", help="optional YAML file, then key=value overrides")
    ap.add_argument("--reference", action="store_true", help="print the configuration reference (markdown)")
    ns = ap.parse_args(argv)
    if ns.reference:
        print(reference_markdown())
        return 0
    path = ns.args[0] if ns.args and "=" not in ns.args[0] else None
    overrides = ns.args[1:] if path else ns.args
    import yaml

    print(yaml.safe_dump(config_to_dict(load_config(path, overrides)), sort_keys=False), end="")
    return 0
