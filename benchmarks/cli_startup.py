"""How long the CLI takes to answer ``--help``, ``--version`` and bad input, beside ``import torch``.

    python benchmarks/cli_startup.py [--repeats N]

Each command runs as a fresh ``python -m normswap ...`` process from the checkout (wall clock, process
start to exit, median of N runs, runs interleaved so that a busy machine slows every row alike). The last
column is the ratio to a fresh ``python -c "import torch"``: the CLI imports torch and transformers only
inside command bodies, so these answers should stay a small fraction of one torch import.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
COMMANDS = {
    "normswap --help": ["-m", "normswap", "--help"],
    "normswap --version": ["-m", "normswap", "--version"],
    "normswap convert --help": ["-m", "normswap", "convert", "--help"],
    "normswap convert (usage error)": ["-m", "normswap", "convert"],
    "normswap convert SmolLM2-135M (mistyped)": ["-m", "normswap", "convert", "SmolLM2-135M", "-o", "x"],
    "normswap convert --max-memory a": ["-m", "normswap", "convert", "x", "-o", "y", "--max-memory", "a"],
    'python -c "import torch"': ["-c", "import torch"],
}


def wall_time(args: list[str]) -> float:
    """Seconds from the start of ``python ARGS`` to its exit (its output discarded)."""
    start = time.perf_counter()
    subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, check=False)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7, help="runs per command (default 7)")
    repeats = parser.parse_args().repeats
    times: dict[str, list[float]] = {name: [] for name in COMMANDS}
    for args in COMMANDS.values():  # warm the file cache once
        wall_time(args)
    for _ in range(repeats):
        for name, args in COMMANDS.items():
            times[name].append(wall_time(args))
    torch_median = statistics.median(times['python -c "import torch"'])
    width = max(len(name) for name in COMMANDS)
    print(f"{'command'.ljust(width)}  median s  min s   / import torch   ({repeats} runs each)")
    for name, runs in times.items():
        median = statistics.median(runs)
        print(f"{name.ljust(width)}  {median:8.3f}  {min(runs):5.3f}  {median / torch_median:6.2f}x")


if __name__ == "__main__":
    main()
