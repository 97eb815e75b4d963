"""Write the calculator agent's rows (verl's layout: chat messages under ``prompt``, the answer at
``reward_model.ground_truth``): products of a two-digit and a one- or two-digit number, which the 135M model
cannot do in its head but a calculator can.

    python examples/agent_calculator/data.py examples/agent_calculator/train.jsonl [--rows 256] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import random

SYSTEM = "You are a careful assistant. Use the calculator tool for arithmetic, then give the final number."


def rows(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        a, b = rng.randint(11, 99), rng.randint(3, 49)
        out.append(
            {
                "data_source": "agent_calculator",
                "prompt": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"What is {a} * {b}?"}],
                "reward_model": {"style": "rule", "ground_truth": str(a * b)},
                "extra_info": {"index": i, "a": a, "b": b},
            }
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    with open(args.out, "w") as f:
        for row in rows(args.rows, args.seed):
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
