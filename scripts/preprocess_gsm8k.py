#!/usr/bin/env python3
"""Convert a local copy of GSM8K to verl's row schema: <local_save_dir>/{train,test}.parquet.

This script never downloads anything. Bring GSM8K's ``main`` config yourself, as parquet
(``train-00000-of-00001.parquet`` / ``test-...``) or JSON lines (``train.jsonl`` /
``test.jsonl``), then::

    python scripts/preprocess_gsm8k.py --input_dir /path/to/gsm8k --local_save_dir ~/data/gsm8k

and train with ``data.train_files=[~/data/gsm8k/train.parquet]
data.val_files=[~/data/gsm8k/test.parquet]``. The conversion itself lives in
``hybridflow.data.gsm8k.convert_gsm8k`` (tested there).
"""

from __future__ import annotations

import argparse
import sys

import pyarrow.parquet as pq

from hybridflow.data.dataset import DataError
from hybridflow.data.gsm8k import convert_gsm8k


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--input_dir",
        required=True,
        help="Directory with GSM8K train/test files (parquet or jsonl with 'question' and 'answer').",
    )
    parser.add_argument(
        "--local_save_dir",
        default="~/data/gsm8k",
        help="Where to write train.parquet and test.parquet (default: %(default)s, as in verl).",
    )
    args = parser.parse_args(argv)
    try:
        written = convert_gsm8k(args.input_dir, args.local_save_dir)
    except DataError as exc:
        print(f"preprocess_gsm8k: {exc}", file=sys.stderr)
        return 2
    for split, path in written.items():
        print(f"{split}: {pq.read_metadata(path).num_rows} rows -> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
