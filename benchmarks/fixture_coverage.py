"""Which tensors the tiny-model fixture moves off their initial values, per zoo row: by parameter
(``normswap.zoo.randomize_constants``, the fixture) against through the walk (the sites ``normswap.inspect``
finds, their weight, bias and running statistics: how the fixture worked before).

    python benchmarks/fixture_coverage.py [--out results.md] [ROW ...]

Each row's model is built as ``normswap.zoo.tiny_model`` builds it, without the re-randomization, then
re-randomized both ways on two copies. Norm tensors are named independently of both: the parameters and
buffers of a module whose class name contains "norm", and those the walk moved (``custom``'s ``Squash`` and
``Standardize`` say nothing). Per row: how many norm tensors each way moved, how many tensors the fixture
moves in all (linear biases, layer scales too), and each norm tensor the walk left at its initial value (a
walk miss: a norm ``inspect`` does not list). Exit 1 if the walk moved a tensor the fixture does not.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time


def walk_moved(model, seed: int = 1) -> None:
    """The former fixture: each site ``normswap.inspect`` finds, identity + U(-0.5, 0.5), in place."""
    import torch

    from normswap.convert import inspect

    gen = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for site in inspect(model):
            module = model.get_submodule(site.name)
            for attr, base in (
                (site.weight, 1.0 - site.offset),
                (site.bias, 0.0),
                (site.mean, 0.0),
                (site.var, 1.0),
            ):
                if attr is not None:
                    t = getattr(module, attr)
                    t.copy_(base + torch.rand(t.shape, generator=gen, dtype=torch.float64) - 0.5)


def moved(before, after) -> set[str]:
    a, b = before.state_dict(), after.state_dict()
    return {k for k in a if a[k].is_floating_point() and not a[k].equal(b[k])}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("rows", nargs="*", help="zoo rows (default: all)")
    parser.add_argument("--out", help="also write the table to this Markdown file")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    import torch
    import transformers

    from normswap import zoo

    fixture = zoo.randomize_constants
    zoo.randomize_constants = lambda model, seed=1: []  # tiny_model as transformers initialized it
    lines = [
        "| row | norm tensors: walk | by parameter | all tensors by parameter | walk misses |",
        "|---|---:|---:|---:|---|",
    ]
    totals, failed = [0, 0, 0], False
    start = time.perf_counter()
    for entry in [e for e in zoo.ZOO if not args.rows or e.name in args.rows]:
        raw = zoo.tiny_model(entry.model_type, **entry.overrides)
        by_walk, by_param = copy.deepcopy(raw), copy.deepcopy(raw)
        walk_moved(by_walk)
        fixture(by_param)
        old, new = moved(raw, by_walk), moved(raw, by_param)
        norms = set(old)
        for name, module in raw.named_modules():
            if "norm" in type(module).__name__.lower():
                tensors = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
                norms |= {f"{name}.{n}" if name else n for n, t in tensors if t.is_floating_point()}
        misses = sorted((norms & new) - old)
        failed |= not old <= new
        counts = (len(old), len(norms & new), len(new))
        totals = [t + c for t, c in zip(totals, counts, strict=True)]
        extra = "" if old <= new else f" **walk only: {', '.join(sorted(old - new))}**"
        lines.append(f"| {entry.name} | {' | '.join(map(str, counts))} | {', '.join(misses) or '-'}{extra} |")
    lines.append(f"| **all** | {' | '.join(map(str, totals))} | |")
    head = (
        f"transformers {transformers.__version__}, torch {torch.__version__}; "
        f"{time.perf_counter() - start:.0f} s\n\n"
    )
    table = head + "\n".join(lines) + "\n"
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
