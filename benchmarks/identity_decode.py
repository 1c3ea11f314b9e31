"""Per-call cost of a folded norm at decode sizes: this tree's modules and another revision's, side by side.

A folded RMSNorm holds the identity weight (1, or 0 with Gemma's offset 1). Before, the module decided
"the weight is the identity" per call from a cache keyed on the weight's version counter (stale after a fused
optimizer step or a ``.data`` edit); now the module is built weight-free (``identity_weight=True``), a fact of
its structure. This times both revisions' modules, and a module that multiplies by a random weight, in the
same rounds (``normswap.bench.decode``'s method: blocks of ``CALLS`` calls per candidate in a rotating order,
median over rounds), and checks each output against the HF module it replaces (bit-identical: 0).

    python benchmarks/identity_decode.py --before 43e5e86 [--rounds 60] [--threads 1]
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
SHAPES = ((1, 576), (1, 2048), (8, 2048))
CALLS = 50


def _old_modules(rev: str):
    """``normswap/kernels/modules.py`` of git revision ``rev``, imported as a module of its own."""
    text = subprocess.run(["git", "show", f"{rev}:normswap/kernels/modules.py"], cwd=ROOT, check=True,
                          capture_output=True, text=True).stdout  # fmt: skip
    path = Path(tempfile.mkdtemp()) / "old_modules.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location("normswap.kernels.old_modules", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _candidates(x: torch.Tensor, old) -> dict:
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from normswap.kernels import FusedRMSNorm

    d, dt = x.shape[-1], x.dtype
    g = torch.Generator().manual_seed(0)
    w = (1.0 + torch.rand(d, generator=g) - 0.5).to(dt)
    hf = LlamaRMSNorm(d, eps=1e-6).to(dt).requires_grad_(False)
    hf_one = LlamaRMSNorm(d, eps=1e-6).to(dt).requires_grad_(False)
    gemma_zero = GemmaRMSNorm(d, eps=1e-6).to(dt).requires_grad_(False)
    with torch.no_grad():
        hf.weight.copy_(w)
    old_one = old.FusedRMSNorm(d, 1e-6, dtype=dt)  # weight 1, as a folded norm held it before
    old_gemma = old.FusedRMSNorm(d, 1e-6, offset=1.0, cast_order="fp32", dtype=dt)
    old_w = old.FusedRMSNorm(d, 1e-6, dtype=dt)
    new_one = FusedRMSNorm(d, 1e-6, dtype=dt, identity_weight=True)
    new_gemma = FusedRMSNorm(d, 1e-6, offset=1.0, cast_order="fp32", dtype=dt, identity_weight=True)
    new_w = FusedRMSNorm(d, 1e-6, dtype=dt)
    with torch.no_grad():
        old_w.weight.copy_(w)
        new_w.weight.copy_(w)
    return {
        "HF LlamaRMSNorm, weight 1": (lambda: hf_one(x), None),
        "before: folded Llama norm (weight 1, cached test)": (
            lambda: old_one(x),
            "HF LlamaRMSNorm, weight 1",
        ),
        "after: folded Llama norm (identity_weight)": (lambda: new_one(x), "HF LlamaRMSNorm, weight 1"),
        "HF GemmaRMSNorm, weight 0": (lambda: gemma_zero(x), None),
        "before: folded Gemma norm (weight 0, cached test)": (
            lambda: old_gemma(x),
            "HF GemmaRMSNorm, weight 0",
        ),
        "after: folded Gemma norm (identity_weight)": (lambda: new_gemma(x), "HF GemmaRMSNorm, weight 0"),
        "HF LlamaRMSNorm": (lambda: hf(x), None),
        "before: random weight": (lambda: old_w(x), "HF LlamaRMSNorm"),
        "after: random weight": (lambda: new_w(x), "HF LlamaRMSNorm"),
    }


def run(rev: str, rounds: int, dtypes=("bfloat16", "float32")) -> list[dict]:
    old = _old_modules(rev)
    rows = []
    for n, d in SHAPES:
        for dname in dtypes:
            x = (torch.randn(1, n, d, generator=torch.Generator().manual_seed(1)) * 3).to(
                getattr(torch, dname)
            )
            cands = _candidates(x, old)
            times = {k: [] for k in cands}
            with torch.no_grad():
                outs = {k: f() for k, (f, _) in cands.items()}
                diffs = {k: (outs[k].double() - outs[r].double()).abs().max().item()
                         for k, (_, r) in cands.items() if r}  # fmt: skip
                names = list(cands)
                for r in range(rounds + 1):
                    k0 = r % len(names)
                    for name in names[k0:] + names[:k0]:
                        fn = cands[name][0]
                        t0 = time.perf_counter()
                        for _ in range(CALLS):
                            fn()
                        if r:
                            times[name].append((time.perf_counter() - t0) / CALLS)
            med = {k: statistics.median(v) * 1e6 for k, v in times.items()}
            for name, (_, ref) in cands.items():
                ratio = med[name] / med[ref] if ref else 1.0
                rows.append(dict(shape=f"{n}x{d}", dtype=dname, name=name, us=med[name], ratio=ratio,
                                 diff=diffs.get(name)))  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="git revision whose modules.py is 'before'")
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = run(args.before, args.rounds)
    configs = list(dict.fromkeys((r["shape"], r["dtype"]) for r in rows))
    names = list(dict.fromkeys(r["name"] for r in rows))
    cell = {(r["shape"], r["dtype"], r["name"]): r for r in rows}
    print(
        "| per call, us (/ the HF module it replaces) | " + " | ".join(f"{s} {d}" for s, d in configs) + " |"
    )
    print("|---" * (len(configs) + 1) + "|")
    for name in names:
        vals = []
        for s, d in configs:
            r = cell[(s, d, name)]
            vals.append(f"{r['us']:.1f}" + (f" ({r['ratio']:.2f}x)" if r["diff"] is not None else ""))
        print(f"| {name} | " + " | ".join(vals) + " |")
    worst = max((r["diff"] for r in rows if r["diff"] is not None), default=0.0)
    print(f"\nlargest |output - HF module's|: {worst:g}; torch {torch.__version__}, {args.rounds} rounds")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
