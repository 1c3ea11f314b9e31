"""Benchmark normswap's norm kernels: `normswap bench` (see its --help), writing into benchmarks/results/.

    python benchmarks/bench_norms.py                # the kernel grid of docs/KERNELS.md on the CPU
    python benchmarks/bench_norms.py --device cuda  # adds the triton backend when installed
    python benchmarks/bench_norms.py --model smollm2-135m  # also prefill/decode, original vs converted
    python benchmarks/bench_norms.py --quick --out /tmp/b   # one small shape, 3 rounds (smoke run)

This script is how the committed results in benchmarks/results/ are refreshed: its --out defaults there,
while `normswap bench` writes into ./normswap-bench/. Method and caveats: normswap/bench/ and
docs/KERNELS.md.
"""

import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

if __name__ == "__main__":
    from normswap.cli import main

    results = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    sys.exit(main(["bench", *sys.argv[1:]], default_map={"bench": {"out_dir": results}}))
