"""Generate the ``arith2`` dataset: two-digit sums and products as chat messages, in verl's parquet layout.

Each row is what verl's ``examples/data_preprocess/gsm8k.py`` writes: ``data_source``, ``prompt`` (a
list of chat messages), ``ability``, ``reward_model: {style: rule, ground_truth}`` and ``extra_info``
(``split``, ``index``, ``question``). A question is ``a+b`` (two two-digit numbers) or ``a*b`` (a
two-digit number times a one-digit one), asked after one worked example turn that shows the
``#### N`` answer format; ``reward.py`` scores it. SmolLM2-135M-Instruct answers 0.25-0.35 of them
right greedily before any RL (docs/learning.md), so there is room to learn.

    python examples/arith2/data.py OUT_DIR [--train 2048] [--val 128] [--seed 0]

writes ``OUT_DIR/train.parquet`` and ``OUT_DIR/val.parquet`` (disjoint questions).
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

DATA_SOURCE = "arith2"
INSTRUCTION = 'What is {q}? Give the final answer after "####".'
EXAMPLE = [
    {"role": "user", "content": INSTRUCTION.format(q="12+34")},
    {"role": "assistant", "content": "12+34 = 46\n#### 46"},
]


def question(rng: random.Random) -> tuple[str, int]:
    """One question and its answer: a two-digit sum or a two-digit by one-digit product."""
    if rng.random() < 0.5:
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        return f"{a}+{b}", a + b
    a, b = rng.randint(10, 99), rng.randint(2, 9)
    return f"{a}*{b}", a * b


def rows(n_train: int, n_val: int, seed: int = 0) -> dict[str, list[dict]]:
    """``{"train": [...], "val": [...]}``, verl's row layout; no question appears in both splits."""
    rng = random.Random(seed)
    seen: set[str] = set()
    out: dict[str, list[dict]] = {}
    for split, n in (("val", n_val), ("train", n_train)):
        out[split] = []
        while len(out[split]) < n:
            q, answer = question(rng)
            if q in seen:
                continue
            seen.add(q)
            out[split].append(
                {
                    "data_source": DATA_SOURCE,
                    "prompt": [*EXAMPLE, {"role": "user", "content": INSTRUCTION.format(q=q)}],
                    "ability": "math",
                    "reward_model": {"style": "rule", "ground_truth": str(answer)},
                    "extra_info": {"split": split, "index": len(out[split]), "question": q},
                }
            )
    return out


def write(out_dir: Path, n_train: int = 2048, n_val: int = 128, seed: int = 0) -> dict[str, Path]:
    """Write ``train.parquet`` and ``val.parquet`` into ``out_dir``; their paths."""
    from datasets import Dataset

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split, split_rows in rows(n_train, n_val, seed).items():
        paths[split] = out_dir / f"{split}.parquet"
        Dataset.from_list(split_rows).to_parquet(str(paths[split]))
    return paths


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--train", type=int, default=2048)
    ap.add_argument("--val", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    for split, path in write(args.out, args.train, args.val, args.seed).items():
        print(split, path)


if __name__ == "__main__":
    main()
