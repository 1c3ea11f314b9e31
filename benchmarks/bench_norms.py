"""Benchmark normswap's norm kernels against HF eager norms, torch's norms and a same-size copy.

    python benchmarks/bench_norms.py                 # full grid of issue 5, CPU, results in benchmarks/results/
    python benchmarks/bench_norms.py --device cuda   # adds the triton backend when installed
    python benchmarks/bench_norms.py --quick         # one small shape, 3 rounds (smoke run)

Prints a markdown table (median time / copy, and GB/s) and writes norm_kernels.json (+ .png with
matplotlib). Method and caveats: normswap/bench.py and docs/KERNELS.md.
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from normswap import bench  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"), help="results folder")
    p.add_argument("--device", default="cpu")
    p.add_argument("--rounds", type=int, default=15, help="timed rounds per candidate (median is reported)")
    p.add_argument("--dtypes", default=",".join(bench.DTYPES), help="comma-separated dtype names")
    p.add_argument("--backends", default=None, help="comma-separated normswap backends (default: all usable)")
    p.add_argument("--no-heap-reuse", action="store_true", help="keep glibc's mmap of large outputs")
    p.add_argument("--quick", action="store_true", help="one [1024, 576] shape, 3 rounds")
    a = p.parse_args(argv)
    if a.rounds < 1:
        print(f"error: --rounds must be >= 1, got {a.rounds}", file=sys.stderr)
        return 2
    heap = False if a.no_heap_reuse else bench.reuse_heap()
    shapes = ((1024, 576),) if a.quick else bench.SHAPES
    rounds = 3 if a.quick else a.rounds
    backends = a.backends.split(",") if a.backends else None
    try:
        rows = bench.bench_kernels(shapes, a.dtypes.split(","), backends, rounds, a.device, log=print)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(bench.format_table(rows))
    for path in bench.write_results(rows, a.out, bench.machine_info(a.device, heap)):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
