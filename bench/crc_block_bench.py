"""Choose the CRC block size: bytes over-read by verified partial reads vs the cost of checksumming.

For each candidate block size B this prints, in one run:
  * bytes read / bytes needed for verified loads of typical TP reshards (column slices TP2/4/8 of
    rows of 8, 16 and 32 KiB; an unaligned slice; a row half), from the real load planner;
  * the block-CRC table size relative to the data (stored in a sidecar file per data file);
  * the writer's cost of computing cumulative block CRCs over 64 MiB relative to one plain CRC32 pass.

    python bench/crc_block_bench.py
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import zlib

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from elastor_ds.checkpoint.planning.load_plan import Request, plan_load  # noqa: E402
from elastor_ds.checkpoint.planning.manifest import BlockTable, Chunk, TensorEntry  # noqa: E402
from elastor_ds.checkpoint.fileformat import cumulative_crcs  # noqa: E402
from elastor_ds.layout.region import Region  # noqa: E402

SIZES = [1024, 4096, 16384, 65536, 262144]
ROWS = 256


def ratio(block: int, cols: int, itemsize: int, box: Region) -> float:
    dtype = {2: "bfloat16", 4: "float32"}[itemsize]
    length = ROWS * cols * itemsize
    ch = Chunk("f", "k", Region((0, 0), (ROWS, cols)), 64, length, 0, BlockTable(block, "t", 0))
    plan = plan_load({"w": TensorEntry("w", (ROWS, cols), dtype, (ch,))}, [Request("w", box, 0)])
    return (plan.bytes_read + plan.table_bytes) / plan.bytes_needed


def main() -> None:
    # no options: --help describes the bench, and a stray argument is refused instead of ignored
    argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0]).parse_args()
    patterns = []
    for cols, it, label in [(4096, 2, "8 KiB rows (bf16 h=4096)"), (4096, 4, "16 KiB rows (fp32 h=4096)"),
                            (8192, 4, "32 KiB rows (fp32 h=8192)")]:
        for tp in (2, 4, 8):
            w = cols // tp
            patterns.append((f"{label}, column 1/{tp}", cols, it, Region((0, w), (ROWS, w))))
    patterns.append(("32 KiB rows, unaligned columns 333..1334", 8192, 4, Region((0, 333), (ROWS, 1001))))
    patterns.append(("32 KiB rows, row half", 8192, 4, Region((ROWS // 2, 0), (ROWS // 2, 8192))))
    data = os.urandom(64 << 20)
    mv = memoryview(data)
    t0 = time.perf_counter()
    zlib.crc32(mv)
    plain = time.perf_counter() - t0
    head = f"{'pattern (bytes read / bytes needed)':<48}" + "".join(f"{b // 1024:>8} KiB" for b in SIZES)
    print(head)
    for label, cols, it, box in patterns:
        print(f"{label:<48}" + "".join(f"{ratio(b, cols, it, box):>12.3f}" for b in SIZES))
    print(f"{'table bytes / data bytes':<48}" + "".join(f"{4 / b:>12.5f}" for b in SIZES))
    costs = []
    for b in SIZES:
        t0 = time.perf_counter()
        cumulative_crcs(mv, b)
        costs.append((time.perf_counter() - t0) / plain)
    print(f"{'write: block CRCs / one plain CRC32 pass':<48}" + "".join(f"{c:>12.2f}" for c in costs))


if __name__ == "__main__":
    main()
