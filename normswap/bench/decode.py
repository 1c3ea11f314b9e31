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


# Targets at decode sizes: on the CPU the fused modules cost no more per call than the HF module they
# replace (3% allowed for timing noise: a module that makes the very same call as the HF one, as
# FusedLayerNorm does, measures 0.98-1.02x of it); on CUDA each module's own cost, eager, at most
# CUDA_DECODE_OVERHEAD_US above torch's call of the same computation (F.rms_norm with the weight, without it
# for an identity weight, which the module drops; nn.LayerNorm).
CPU_DECODE_RATIO = 1.03
CUDA_DECODE_OVERHEAD_US = 3.0
TORCH_RMS_NO_WEIGHT = "F.rms_norm, no weight"


def decode_targets(rows: list[dict], device: str) -> list[str]:
    """One verdict line per decode configuration and fused module (``auto`` backend)."""
    cuda = device.startswith("cuda")
    pairs = ((FUSED_RMS, HF_RMS, TORCH_RMS), (FUSED_ONE, HF_RMS, TORCH_RMS_NO_WEIGHT), (FUSED_LN, LN, LN))
    cell = {(r["rows"], r["hidden"], r["dtype"], r["name"]): r for r in rows}
    lines = []
    for rws, hidden, dtype in dict.fromkeys((r["rows"], r["hidden"], r["dtype"]) for r in rows):
        for name, hf, torch_ref in pairs:
            mine = cell.get((rws, hidden, dtype, name))
            base = cell.get((rws, hidden, dtype, torch_ref if cuda else hf))
            if mine is None or base is None:
                continue
            head = f"decode {rws}x{hidden} {dtype} {name}: {mine['per_call_us']:.1f} us per call"
            if cuda:
                extra = mine["per_call_us"] - base["per_call_us"]
                ok = extra <= CUDA_DECODE_OVERHEAD_US
                lines.append(
                    f"{head}, {extra:+.1f} us vs {base['name']} (target <= +{CUDA_DECODE_OVERHEAD_US:g} us): "
                    f"{'met' if ok else 'missed'}"
                )
                continue
            ratio = mine["per_call_us"] / base["per_call_us"]
            lines.append(
                f"{head}, {ratio:.2f}x {base['name']} (target <= {CPU_DECODE_RATIO}x): "
                f"{'met' if ratio <= CPU_DECODE_RATIO else 'missed'}"
            )
    return lines


# ---------------------------------------------------------------------------------------------------------
# Under a CUDA graph: what a norm costs where decode runs in production (transformers' compiled static
# cache, vLLM): launches replayed by the GPU, no Python per call.

GRAPH_CALLS = 100


def bench_decode_graphs(
    shapes=None,
    dtypes=("bfloat16", "float32"),
    backends: list[str] | None = None,
    rounds: int = 20,
    device: str = "cuda",
    calls: int = GRAPH_CALLS,
) -> list[dict]:
    """Per-call time of each decode candidate (the same as ``bench_decode``'s) captured ``calls`` times in
    one CUDA graph and replayed: the replay's CUDA-event time over ``calls``, median over ``rounds``
    replays, candidates in a rotating order.

    On the CPU there is no graph: the same code runs the ``calls`` calls directly (a dry run of the path,
    rows marked ``graph: False``; the times are eager CPU times, not a graph's).

    Returns:
        One dict per (shape, dtype, candidate): ``rows, hidden, dtype, name, graph, per_call_us`` (None
        when the candidate could not be captured), ``ratio_to_torch`` (to ``F.rms_norm`` replayed the same
        way), ``error`` (why capture failed, else None).

    Raises:
        ValueError: ``rounds`` or ``calls`` below 1; a cuda ``device`` this torch cannot see.
    """
    if rounds < 1 or calls < 1:
        raise ValueError(f"rounds and calls must be >= 1, got {rounds} and {calls}")
    dev = torch.device(device)
    graph = dev.type == "cuda"
    if graph and not torch.cuda.is_available():
        raise ValueError(f"device {device!r}: this torch sees no CUDA device")
    if shapes is None:
        shapes = CUDA_SHAPES if graph else CPU_SHAPES
    backends = [be for be in (backends or []) if be != "compiled"]
    out = []
    for rows, hidden in shapes:
        for dname in dtypes:
            dt = getattr(torch, dname)
            gen = torch.Generator(device="cpu").manual_seed(1)
            x = (torch.randn(1, rows, hidden, generator=gen) * 3).to(dev, dt)
            cands = _candidates(x, backends)
            replay: dict[str, Callable] = {}
            errors: dict[str, str] = {}
            with torch.no_grad():
                for name, (fn, _) in cands.items():
                    try:
                        replay[name] = _capture(fn, calls, dev) if graph else _direct(fn, calls)
                    except Exception as error:  # a candidate that cannot be captured (a sync, a host read)
                        errors[name] = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
                times: dict[str, list[float]] = {n: [] for n in replay}
                names = list(replay)
                for r in range(rounds):
                    k = r % len(names)
                    for name in names[k:] + names[:k]:
                        times[name].append(replay[name]() / calls)
            med = {n: statistics.median(v) for n, v in times.items()}
            torch_med = med.get(TORCH_RMS)
            for name in cands:
                m = med.get(name)
                out.append(
                    {
                        "rows": rows,
                        "hidden": hidden,
                        "dtype": dname,
                        "name": name,
                        "graph": graph,
                        "per_call_us": None if m is None else m * 1e6,
                        "ratio_to_torch": None if m is None or not torch_med else m / torch_med,
                        "error": errors.get(name),
                    }
                )
            del replay
            if graph:
                torch.cuda.synchronize(dev)
    return out


def _capture(fn: Callable, calls: int, dev: torch.device) -> Callable[[], float]:
    """Capture ``calls`` calls of ``fn`` in a CUDA graph (after warm-up calls on a side stream, as
    ``torch.cuda.graphs`` requires: kernels compiled, caches filled); return a function that replays it
    once and gives the seconds it took (CUDA events)."""
    stream = torch.cuda.Stream(dev)
    stream.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream(dev).wait_stream(stream)
    torch.cuda.synchronize(dev)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    g.replay()  # the first replay uploads the graph
    torch.cuda.synchronize(dev)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def run() -> float:
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    return run  # holds the graph (and its memory pool) as long as it lives


def _direct(fn: Callable, calls: int) -> Callable[[], float]:
    """The CPU dry run of ``_capture``: warm-up calls, then a function timing ``calls`` direct calls."""
    for _ in range(3):
        fn()

    def run() -> float:
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        return time.perf_counter() - t0

    return run


def format_graph_table(rows: list[dict]) -> str:
    """Markdown table of ``bench_decode_graphs`` rows: ``us per call (ratio to F.rms_norm)``, or the reason a
    candidate could not be captured."""
    from normswap.bench.report import pivot_table

    def cell(r):
        if r["per_call_us"] is None:
            return f"not captured ({r['error'][:60]})"
        ratio = "" if r["ratio_to_torch"] is None else f" ({r['ratio_to_torch']:.2f}x)"
        return f"{r['per_call_us']:.2f}{ratio}"

    graph = all(r["graph"] for r in rows)
    corner = "per call under a CUDA graph, us (/ F.rms_norm)" if graph else "dry run (no graph), us per call"
    return pivot_table(rows, "rows", corner, cell)


def format_decode_table(rows: list[dict]) -> str:
    """Markdown table: candidates by (rows x hidden, dtype), cells ``us per call (ratio to HF module)``."""
    from normswap.bench.report import pivot_table

    corner = "per call, us (/ HF LlamaRMSNorm)"
    return pivot_table(rows, "rows", corner, lambda r: f"{r['per_call_us']:.1f} ({r['ratio_to_hf']:.2f}x)")
