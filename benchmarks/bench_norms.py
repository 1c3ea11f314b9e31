"""Benchmark normswap's norm kernels: the same as ``normswap bench`` (see ``normswap bench --help``).

    python benchmarks/bench_norms.py                # issue 5's grid on the CPU -> benchmarks/results/
    python benchmarks/bench_norms.py --device cuda  # adds the triton backend when installed
    python benchmarks/bench_norms.py --model smollm2-135m  # also prefill/decode, original vs converted
    python benchmarks/bench_norms.py --quick --out /tmp/b   # one small shape, 3 rounds (smoke run)

It writes into benchmarks/results/ (the committed results) unless --out says otherwise; `normswap bench`
writes into ./normswap-bench/.

Method and caveats: normswap/bench/ and docs/KERNELS.md.
"""

import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

if __name__ == "__main__":
    from normswap.cli import main

    sys.exit(main(["bench", "--out", os.path.join(os.path.dirname(__file__), "results"), *sys.argv[1:]]))
