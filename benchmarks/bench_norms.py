"""Benchmark normswap's norm kernels against HF eager norms, torch's norms and a same-size copy.

    python benchmarks/bench_norms.py                # issue 5's grid on the CPU -> benchmarks/results/
    python benchmarks/bench_norms.py --device cuda  # adds the triton backend when installed
    python benchmarks/bench_norms.py --model smollm2-135m  # also prefill/decode, original vs converted
    python benchmarks/bench_norms.py --quick        # one small shape, 3 rounds (smoke run)

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
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--quick", action="store_true", help="one [1024, 576] shape, 3 rounds")
    p.add_argument("--model", default=None, help="also time prefill/decode of MODEL, original vs converted")
    p.add_argument("--model-rounds", type=int, default=5)
    p.add_argument("--no-kernels", action="store_true", help="skip the kernel grid (with --model)")
    a = p.parse_args(argv)
    from normswap.errors import NormswapError

    try:
        bench.run(
            a.out,
            device=a.device,
            shapes=((1024, 576),) if a.quick else bench.SHAPES,
            dtypes=a.dtypes.split(","),
            backends=a.backends.split(",") if a.backends else None,
            rounds=3 if a.quick else a.rounds,
            heap_reuse=not a.no_heap_reuse,
            threads=a.threads,
            kernels=not a.no_kernels,
            model=a.model,
            model_rounds=a.model_rounds,
        )
    except (ValueError, NormswapError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
