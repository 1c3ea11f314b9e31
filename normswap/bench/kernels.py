"""The kernel grid: normswap's norm ops against HF eager modules, torch's norms and a same-size copy.

A norm reads its input once and writes its output once, so ``y.copy_(x)`` into a preallocated ``y`` is
its memory roofline. Every candidate is timed side by side in one process, interleaved (one call of each
per round, in a rotating order) so that load from other processes hits all of them alike; we report the
median over rounds, the ratio to the copy's median and the bandwidth (bytes read + written per second).

Allocation: each norm returns a fresh tensor. glibc serves blocks above 32 MiB with a new ``mmap``, so
a fresh [16384, 2048] float32 output page-faults and is zeroed by the kernel on every call, which costs
more than the norm itself and is not a property of the kernel (model activations are far smaller and
reuse the heap). ``reuse_heap`` therefore asks glibc (``mallopt``) to serve large blocks from the heap
so freed outputs are reused; ``x.clone()`` (allocate + copy) is also reported so the effect can be read
off.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

from normswap.kernels import FusedRMSNorm, layer_norm, rms_norm

SHAPES = ((4096, 576), (16384, 2048), (8192, 4096))
DTYPES = ("float32", "bfloat16")
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # glibc malloc.h


def reuse_heap() -> bool:
    """Make glibc serve large blocks from the (reused) heap instead of fresh mmaps; False if not glibc."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        ok = libc.mallopt(_M_MMAP_MAX, 0) == 1
        return ok and libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1) == 1
    except (OSError, AttributeError):
        return False


def default_backends(device: torch.device) -> list[str]:
    """Backends worth timing on ``device``: eager, torch, compiled, and triton on CUDA when installed."""
    names = ["eager", "torch", "compiled"]
    if device.type == "cuda":
        from normswap.kernels.ops import _has_triton

        if _has_triton():
            names.append("triton")
    return names


def _candidates(x: torch.Tensor, backends: list[str]) -> dict[str, tuple[Callable, int, str | None]]:
    """name -> (zero-arg callable, bytes it moves, name of the candidate it must agree with or None).

    Weights are random around the identity (``1 + U(-0.5, 0.5)``, Gemma's ``U(-0.5, 0.5)``).
    """
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    d, dt, dev = x.shape[-1], x.dtype, x.device
    g = torch.Generator(device="cpu").manual_seed(0)  # the same values on every device
    w = (1.0 + torch.rand(d, generator=g, device="cpu") - 0.5).to(dev, dt)
    wg = (torch.rand(d, generator=g, device="cpu") - 0.5).to(dev, dt)
    b = (torch.rand(d, generator=g, device="cpu") - 0.5).to(dev, dt)
    llama = LlamaRMSNorm(d, eps=1e-6).to(dev, dt)
    gemma = GemmaRMSNorm(d, eps=1e-6).to(dev, dt)
    ln = nn.LayerNorm(d, eps=1e-5).to(dev, dt)
    with torch.no_grad():
        llama.weight.copy_(w)
        gemma.weight.copy_(wg)
        ln.weight.copy_(w)
        ln.bias.copy_(b)
    y = torch.empty_like(x)
    io = 2 * x.numel() * x.element_size()
    hf_llama, hf_gemma, hf_ln = "HF LlamaRMSNorm", "HF GemmaRMSNorm", "nn.LayerNorm"
    c: dict[str, tuple[Callable, int, str | None]] = {
        "copy": (lambda: y.copy_(x), io, None),
        "clone (alloc+copy)": (lambda: x.clone(), io, None),
        hf_llama: (lambda: llama(x), io, None),
        hf_gemma: (lambda: gemma(x), io, None),
        hf_ln: (lambda: ln(x), io, None),
        "F.rms_norm": (lambda: torch.nn.functional.rms_norm(x, (d,), w, 1e-6), io, hf_llama),
    }
    # Identity weights (most norms of a folded model): the module drops the weight (modules.py).
    one = LlamaRMSNorm(d, eps=1e-6).to(dev, dt)
    fused_one = FusedRMSNorm(d, 1e-6, device=dev, dtype=dt, identity_weight=True)  # a folded norm
    c[HF_ONE] = (lambda: one(x), io, None)
    c["F.rms_norm, no weight"] = (lambda: torch.nn.functional.rms_norm(x, (d,), None, 1e-6), io, HF_ONE)
    c["normswap FusedRMSNorm weight 1 [auto]"] = (lambda: fused_one(x), io, HF_ONE)
    if dev.type == "cuda" or "compiled" in backends:
        # torch.compile of the HF module as users would write it (dynamo's defaults, no precision flags).
        # One compile per dtype and shape kind: raise dynamo's recompile limit (8) so that a grid of many
        # shapes and dtypes never falls back to eager silently (this process only benchmarks).
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        llama_c = torch.compile(llama)
        c["torch.compile(HF LlamaRMSNorm)"] = (lambda: llama_c(x), io, hf_llama)
    for name, (fn, ref) in _liger(x, w, b).items():
        c[name] = (fn, io, {"llama": hf_llama, "layer": hf_ln}[ref])
    for be in backends:
        c[f"normswap rms_norm llama [{be}]"] = (lambda be=be: rms_norm(x, w, 1e-6, backend=be), io, hf_llama)
        c[f"normswap rms_norm gemma [{be}]"] = (
            lambda be=be: rms_norm(x, wg, 1e-6, offset=1.0, cast_order="fp32", backend=be),
            io,
            hf_gemma,
        )
        c[f"normswap layer_norm [{be}]"] = (lambda be=be: layer_norm(x, w, b, 1e-5, backend=be), io, hf_ln)
    if "compiled" in backends:
        # What inductor reaches without the norm's row reduction: the floor of the compiled backend.
        from normswap.kernels.compiled import compiled_function

        scale, sum_sq = compiled_function(_scale_rows), compiled_function(_sum_squares)
        c[FLOOR_ONE_PASS] = (lambda: scale(x, w), io, None)
        c[FLOOR_READ] = (lambda: sum_sq(x), io // 2, None)
    return c


HF_ONE = "HF LlamaRMSNorm, weight 1"


def liger_available() -> bool:
    """Whether Liger-Kernel imports (an optional anchor: ``pip install liger-kernel``, never a dependency)."""
    try:
        import liger_kernel.transformers  # noqa: F401
    except Exception:  # absent, or broken against this torch/triton: the benchmark runs without it
        return False
    return True


def _liger(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> dict[str, tuple[Callable, str]]:
    """Liger-Kernel's RMSNorm (llama casting) and LayerNorm with the benchmark's parameters, on CUDA when
    importable: name -> (zero-arg callable, "llama" or "layer", the HF module each reproduces)."""
    if x.device.type != "cuda" or not liger_available():
        return {}
    from liger_kernel.transformers import LigerLayerNorm, LigerRMSNorm

    d = x.shape[-1]
    out = {}
    try:
        rms = LigerRMSNorm(d, eps=1e-6, casting_mode="llama").to(x.device, x.dtype).requires_grad_(False)
        rms.weight.copy_(w)
        out["Liger RMSNorm"] = (lambda: rms(x), "llama")
    except Exception:  # another Liger version's signature
        pass
    try:
        ln = LigerLayerNorm(d, eps=1e-5).to(x.device, x.dtype).requires_grad_(False)
        ln.weight.copy_(w)
        if getattr(ln, "bias", None) is not None:
            ln.bias.copy_(b)
            out["Liger LayerNorm"] = (lambda: ln(x), "layer")
    except Exception:
        pass
    return out


# Two compiled reference kernels, timed beside the norms when the compiled backend is: a norm's second
# pass (read a row, scale it, round once, write) and its first pass (read a row, sum its squares in
# float32). A fused norm runs both per row; their ratios to the copy bound what inductor can reach.
FLOOR_ONE_PASS = "floor: compiled x * w (one pass)"
FLOOR_READ = "floor: compiled row sum of squares (read only)"


def _scale_rows(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x.float() * w.float()).to(x.dtype)


def _sum_squares(x: torch.Tensor) -> torch.Tensor:
    return x.float().pow(2).sum(-1)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# On CUDA one call of a norm over 64 MiB takes ~30 us, about as long as a launch plus a synchronize; timed
# one call at a time, that fixed cost would pull every ratio towards 1. So each CUDA sample is the mean of
# CUDA_CALLS back-to-back calls between two CUDA events.
CUDA_CALLS = 20


def _time_call(fn: Callable, device: torch.device) -> float:
    """Seconds one call of ``fn`` takes: wall clock of one call on the CPU; on CUDA the event-timed mean of
    ``CUDA_CALLS`` calls."""
    if device.type != "cuda":
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(CUDA_CALLS):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / CUDA_CALLS


def bench_kernels(
    shapes=SHAPES,
    dtypes=DTYPES,
    backends: list[str] | None = None,
    rounds: int = 15,
    device: str = "cpu",
    log: Callable[[str], None] | None = None,
) -> list[dict]:
    """Time every candidate for every ``(tokens, hidden)`` in ``shapes`` and dtype name in ``dtypes``.

    Args:
        shapes: ``(tokens, hidden)`` pairs; the input is ``randn(tokens, hidden) * 3``.
        dtypes: dtype names (``"float32"``, ``"bfloat16"``, ``"float16"``).
        backends: normswap backends to time (default ``default_backends(device)``).
        rounds: timed rounds after one warm-up call each (the warm-up time is reported as
            ``first_call_s``: for the compiled backend it includes compiling). A round's sample is one
            call's wall-clock time on the CPU and the CUDA-event mean of ``CUDA_CALLS`` calls on CUDA.
        device: torch device string.
        log: called with a line of progress text, or None.

    Returns:
        One dict per (shape, dtype, candidate): ``tokens, hidden, dtype, name, median_s, ratio_to_copy,
        gb_per_s, first_call_s``, and ``agrees_with``/``max_abs_diff``: the HF module a norm candidate
        reproduces and the largest difference of its output from that module's (0.0 = bit-identical).

    Raises:
        ValueError: ``rounds < 1`` or an argument ``check_kernel_args`` refuses.
    """
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    check_kernel_args(device, dtypes, backends)
    dev = torch.device(device)
    backends = default_backends(dev) if backends is None else list(backends)
    rows = []
    for tokens, hidden in shapes:
        for dname in dtypes:
            dt = getattr(torch, dname)  # checked by check_kernel_args
            gen = torch.Generator(device="cpu").manual_seed(1)
            x = (torch.randn(tokens, hidden, generator=gen, device="cpu") * 3).to(dev, dt)
            cands = _candidates(x, backends)
            first, times, diff = {}, {n: [] for n in cands}, {}
            refs = {r for _, _, r in cands.values() if r is not None}
            outputs = {}
            with torch.inference_mode():
                for name, (fn, _, ref) in cands.items():
                    t0 = time.perf_counter()
                    out = fn()
                    _sync(dev)
                    first[name] = time.perf_counter() - t0
                    if name in refs:
                        outputs[name] = out
                    if ref is not None:
                        diff[name] = (out.double() - outputs[ref].double()).abs().max().item()
                del outputs
                names = list(cands)
                for r in range(rounds):
                    k = r % len(names)
                    for name in names[k:] + names[:k]:
                        times[name].append(_time_call(cands[name][0], dev))
            copy = statistics.median(times["copy"])
            for name, (_, nbytes, ref) in cands.items():
                med = statistics.median(times[name])
                rows.append(
                    {
                        "tokens": tokens,
                        "hidden": hidden,
                        "dtype": dname,
                        "name": name,
                        "median_s": med,
                        "ratio_to_copy": med / copy,
                        "gb_per_s": nbytes / med / 1e9,
                        "first_call_s": first[name],
                        "agrees_with": ref,
                        "max_abs_diff": diff.get(name),
                    }
                )
            if log is not None:
                log(f"[{tokens}, {hidden}] {dname}: done")
    return rows


def check_kernel_args(device: str, dtypes, backends: list[str] | None) -> None:
    """The kernel grid's arguments, checked before any timing (see ``normswap.bench.run``)."""
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ValueError(f"unknown device {device!r} (cpu or cuda)") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be cpu or cuda, got {device!r}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r}: this torch sees no CUDA device")
    for name in dtypes:
        dt = getattr(torch, name, None)
        if not isinstance(dt, torch.dtype) or not dt.is_floating_point:
            raise ValueError(f"unknown dtype {name!r} (a floating-point dtype such as float32 or bfloat16)")
    from normswap.kernels import resolve_backend

    if backends is not None and not backends:
        raise ValueError("the list of backends is empty (leave it out to time every usable backend)")
    for be in backends or []:
        resolve_backend(be)
        if be == "triton" and be not in default_backends(dev):
            raise ValueError(f"the triton backend runs on cuda with triton installed, not on {device!r}")
