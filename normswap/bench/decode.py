"""Per-call cost of a norm at decode sizes, through the whole module (Python, dispatch, launch, kernel).

At 1-128 rows a norm moves a few KiB: what it costs is the call itself. Every candidate is a module or a
function call as a model makes it, on the same input, timed side by side: each round times a block of
``CALLS`` back-to-back calls of every candidate in a rotating order (on CUDA the block ends with a
synchronize, so a sample is launch plus kernel), and the report is the median per-call time over rounds.
On a shared machine the absolute numbers move with the load; the ratios between candidates measured in
the same rounds are what to read.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

from normswap.kernels import FusedLayerNorm, FusedRMSNorm

CPU_SHAPES = ((1, 576), (1, 2048), (8, 2048))
CUDA_SHAPES = ((1, 2048), (8, 4096), (128, 4096))
CALLS = 50
HF_RMS = "HF LlamaRMSNorm"
FUSED_RMS = "normswap FusedRMSNorm [auto]"
FUSED_ONE = "normswap FusedRMSNorm weight 1 [auto]"
TORCH_RMS = "F.rms_norm"
LN = "nn.LayerNorm"
FUSED_LN = "normswap FusedLayerNorm [auto]"


def _candidates(x: torch.Tensor, backends: list[str]) -> dict[str, tuple[Callable, str | None]]:
    """name -> (zero-arg callable, name of the candidate whose output it must equal, or None)."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    d, dt, dev = x.shape[-1], x.dtype, x.device
    g = torch.Generator(device="cpu").manual_seed(0)
    w = (1.0 + torch.rand(d, generator=g) - 0.5).to(dev, dt)
    b = (torch.rand(d, generator=g) - 0.5).to(dev, dt)
    hf = LlamaRMSNorm(d, eps=1e-6).to(dev, dt)
    hf_one = LlamaRMSNorm(d, eps=1e-6).to(dev, dt)
    ln = nn.LayerNorm(d, eps=1e-5).to(dev, dt)
    fused = FusedRMSNorm(d, 1e-6, device=dev, dtype=dt)
    fused_one = FusedRMSNorm(d, 1e-6, device=dev, dtype=dt, identity_weight=True)  # a folded norm
    fused_ln = FusedLayerNorm(d, 1e-5, device=dev, dtype=dt)
    with torch.no_grad():
        for m in (hf, fused, ln, fused_ln):
            m.weight.copy_(w)
        ln.bias.copy_(b)
        fused_ln.bias.copy_(b)
    c: dict[str, tuple[Callable, str | None]] = {
        HF_RMS: (lambda: hf(x), None),
        "HF LlamaRMSNorm, weight 1": (lambda: hf_one(x), None),
        TORCH_RMS: (lambda: torch.nn.functional.rms_norm(x, (d,), w, 1e-6), None),
        "F.rms_norm, no weight": (lambda: torch.nn.functional.rms_norm(x, (d,), None, 1e-6), None),
        FUSED_RMS: (lambda: fused(x), HF_RMS),
        FUSED_ONE: (lambda: fused_one(x), "HF LlamaRMSNorm, weight 1"),
        LN: (lambda: ln(x), None),
        FUSED_LN: (lambda: fused_ln(x), LN),
    }
    for be in backends:
        if be == "auto":
            continue
        f_be = FusedRMSNorm(d, 1e-6, device=dev, dtype=dt, backend=be)
        ln_be = FusedLayerNorm(d, 1e-5, device=dev, dtype=dt, backend=be)
        with torch.no_grad():
            f_be.weight.copy_(w)
            ln_be.weight.copy_(w)
            ln_be.bias.copy_(b)
        c[f"normswap FusedRMSNorm [{be}]"] = (lambda f=f_be: f(x), HF_RMS)
        c[f"normswap FusedLayerNorm [{be}]"] = (lambda f=ln_be: f(x), LN)
    from normswap.bench.kernels import _liger

    for name, (fn, ref) in _liger(x, w, b).items():
        c[name] = (fn, {"llama": HF_RMS, "layer": LN}[ref])
    return c


def bench_decode(
    shapes=None,
    dtypes=("bfloat16", "float32"),
    backends: list[str] | None = None,
    rounds: int = 30,
    device: str = "cpu",
    calls: int = CALLS,
) -> list[dict]:
    """Median per-call time of each candidate at decode sizes, side by side.

    Args:
        shapes: ``(rows, hidden)`` pairs; default ``CPU_SHAPES`` or ``CUDA_SHAPES``.
        dtypes: dtype names.
        backends: normswap backends to time as forced module backends besides ``auto`` (e.g. ``eager``,
            ``torch``, ``triton``); ``compiled`` is skipped (below ``compiled.MIN_ELEMENTS`` it is eager).
        rounds: timed rounds (after one warm-up block); ``calls``: calls per candidate per round.
        device: ``cpu`` or ``cuda``.

    Returns:
        One dict per (shape, dtype, candidate): ``rows, hidden, dtype, name, per_call_us`` (median over
        rounds), ``ratio_to_hf`` (to ``HF LlamaRMSNorm`` in the same rounds), ``ratio_to_torch`` (to
        ``F.rms_norm``), ``agrees_with`` and ``max_abs_diff`` (0.0 = bit-identical to that module).

    Raises:
        ValueError: ``rounds`` or ``calls`` below 1.
    """
    if rounds < 1 or calls < 1:
        raise ValueError(f"rounds and calls must be >= 1, got {rounds} and {calls}")
    dev = torch.device(device)
    if shapes is None:
        shapes = CUDA_SHAPES if dev.type == "cuda" else CPU_SHAPES
    backends = [be for be in (backends or []) if be != "compiled"]
    out = []
    for rows, hidden in shapes:
        for dname in dtypes:
            dt = getattr(torch, dname)
            gen = torch.Generator(device="cpu").manual_seed(1)
            x = (torch.randn(1, rows, hidden, generator=gen) * 3).to(dev, dt)
            cands = _candidates(x, backends)
            times: dict[str, list[float]] = {n: [] for n in cands}
            with torch.no_grad():  # as in generate(); the norms' weights still require gradients
                ref_out = {n: fn() for n, (fn, _) in cands.items()}
                diff = {
                    n: (ref_out[n].double() - ref_out[r].double()).abs().max().item()
                    for n, (_, r) in cands.items()
                    if r is not None
                }
                del ref_out
                names = list(cands)
                for r in range(rounds + 1):
                    k = r % len(names)
                    for name in names[k:] + names[:k]:
                        fn = cands[name][0]
                        if dev.type == "cuda":
                            torch.cuda.synchronize(dev)
                        t0 = time.perf_counter()
                        for _ in range(calls):
                            fn()
                        if dev.type == "cuda":
                            torch.cuda.synchronize(dev)
                        if r:  # round 0 warms up
                            times[name].append((time.perf_counter() - t0) / calls)
            med = {n: statistics.median(v) for n, v in times.items()}
            for name, (_, ref) in cands.items():
                out.append(
                    {
                        "rows": rows,
                        "hidden": hidden,
                        "dtype": dname,
                        "name": name,
                        "per_call_us": med[name] * 1e6,
                        "ratio_to_hf": med[name] / med[HF_RMS],
                        "ratio_to_torch": med[name] / med[TORCH_RMS],
                        "agrees_with": ref,
                        "max_abs_diff": diff.get(name),
                    }
                )
    return out


# Targets of issue 13 at decode sizes: on the CPU the fused modules cost no more per call than the HF
# module they replace (3% allowed for timing noise: a module that makes the very same call as the HF one,
# as FusedLayerNorm does, measures 0.98-1.02x of it); on CUDA at most 1.25x of torch's own kernel per call,
# through the whole module.
CPU_DECODE_RATIO = 1.03
CUDA_DECODE_RATIO = 1.25


def decode_targets(rows: list[dict], device: str) -> list[str]:
    """One verdict line per decode configuration and fused module (``auto`` backend)."""
    cuda = device.startswith("cuda")
    pairs = ((FUSED_RMS, HF_RMS, TORCH_RMS), (FUSED_ONE, HF_RMS, TORCH_RMS), (FUSED_LN, LN, LN))
    cell = {(r["rows"], r["hidden"], r["dtype"], r["name"]): r for r in rows}
    lines = []
    for rws, hidden, dtype in dict.fromkeys((r["rows"], r["hidden"], r["dtype"]) for r in rows):
        for name, hf, torch_ref in pairs:
            mine = cell.get((rws, hidden, dtype, name))
            base = cell.get((rws, hidden, dtype, torch_ref if cuda else hf))
            if mine is None or base is None:
                continue
            ratio = mine["per_call_us"] / base["per_call_us"]
            bound = CUDA_DECODE_RATIO if cuda else CPU_DECODE_RATIO
            lines.append(
                f"decode {rws}x{hidden} {dtype} {name}: {mine['per_call_us']:.1f} us per call, {ratio:.2f}x "
                f"{base['name']} (target <= {bound}x): {'met' if ratio <= bound else 'missed'}"
            )
    return lines


def format_decode_table(rows: list[dict]) -> str:
    """Markdown table: candidates by (rows x hidden, dtype), cells ``us per call (ratio to HF module)``."""
    from normswap.bench.report import pivot_table

    corner = "per call, us (/ HF LlamaRMSNorm)"
    return pivot_table(rows, "rows", corner, lambda r: f"{r['per_call_us']:.1f} ({r['ratio_to_hf']:.2f}x)")
