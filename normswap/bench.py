"""Norm kernel benchmark: normswap's ops against HF eager modules, torch's norms and a same-size copy.

A norm reads its input once and writes its output once, so ``y.copy_(x)`` into a preallocated ``y`` is
its memory roofline. Every candidate is timed side by side in one process, interleaved (one call of each
per round, in a rotating order) so that load from other processes hits all of them alike; we report the
median over rounds, the ratio to the copy's median and the bandwidth (bytes read + written per second).

Allocation: each norm returns a fresh tensor. glibc serves blocks above 32 MiB with a new ``mmap``, so
a fresh [16384, 2048] float32 output page-faults and is zeroed by the kernel on every call, which costs
more than the norm itself and is not a property of the kernel (model activations are far smaller and
reuse the heap). By default the benchmark therefore asks glibc (``mallopt``) to serve large blocks from
the heap so freed outputs are reused; ``x.clone()`` (allocate + copy) is also reported so the effect can
be read off. ``reuse_heap=False`` keeps the system default.

Entry points: ``bench_kernels`` (returns rows), ``format_table``, ``write_results`` (JSON + optional PNG);
``python benchmarks/bench_norms.py`` runs the full grid of the issue.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from normswap.kernels import layer_norm, rms_norm

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


def _candidates(
    x: torch.Tensor, backends: list[str]
) -> dict[str, tuple[Callable[[], torch.Tensor | None], int]]:
    """name -> (zero-arg callable, bytes it moves). Weights are random around the identity."""
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    d, dt, dev = x.shape[-1], x.dtype, x.device
    g = torch.Generator().manual_seed(0)
    w = (1.0 + torch.rand(d, generator=g) - 0.5).to(dev, dt)
    wg = (torch.rand(d, generator=g) - 0.5).to(dev, dt)
    b = (torch.rand(d, generator=g) - 0.5).to(dev, dt)
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
    c: dict[str, tuple[Callable[[], torch.Tensor | None], int]] = {
        "copy": (lambda: y.copy_(x), io),
        "clone (alloc+copy)": (lambda: x.clone(), io),
        "HF LlamaRMSNorm": (lambda: llama(x), io),
        "HF GemmaRMSNorm": (lambda: gemma(x), io),
        "nn.LayerNorm": (lambda: ln(x), io),
        "F.rms_norm": (lambda: torch.nn.functional.rms_norm(x, (d,), w, 1e-6), io),
    }
    for be in backends:
        c[f"normswap rms_norm llama [{be}]"] = (lambda be=be: rms_norm(x, w, 1e-6, backend=be), io)
        c[f"normswap rms_norm gemma [{be}]"] = (
            lambda be=be: rms_norm(x, wg, 1e-6, offset=1.0, cast_order="fp32", backend=be),
            io,
        )
        c[f"normswap layer_norm [{be}]"] = (lambda be=be: layer_norm(x, w, b, 1e-5, backend=be), io)
    return c


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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
            ``first_call_s``: for the compiled backend it includes compiling).
        device: torch device string.
        log: called with a line of progress text, or None.

    Returns:
        One dict per (shape, dtype, candidate): ``tokens, hidden, dtype, name, median_s, ratio_to_copy,
        gb_per_s, first_call_s``.

    Raises:
        ValueError: unknown dtype name or ``rounds < 1``.
    """
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    dev = torch.device(device)
    backends = default_backends(dev) if backends is None else list(backends)
    rows = []
    for tokens, hidden in shapes:
        for dname in dtypes:
            dt = getattr(torch, dname, None)
            if not isinstance(dt, torch.dtype):
                raise ValueError(f"unknown dtype {dname!r}")
            x = (torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(1)) * 3).to(dev, dt)
            cands = _candidates(x, backends)
            first, times = {}, {n: [] for n in cands}
            with torch.inference_mode():
                for name, (fn, _) in cands.items():
                    t0 = time.perf_counter()
                    fn()
                    _sync(dev)
                    first[name] = time.perf_counter() - t0
                names = list(cands)
                for r in range(rounds):
                    k = r % len(names)
                    for name in names[k:] + names[:k]:
                        fn = cands[name][0]
                        t0 = time.perf_counter()
                        fn()
                        _sync(dev)
                        times[name].append(time.perf_counter() - t0)
            copy = statistics.median(times["copy"])
            for name, (_, nbytes) in cands.items():
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
                    }
                )
            if log is not None:
                log(f"[{tokens}, {hidden}] {dname}: done")
    return rows


def machine_info(device: str = "cpu", heap_reuse: bool | None = None) -> dict:
    """What the numbers were measured on."""
    info = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "device": device,
        "heap_reuse": heap_reuse,
        "backend_env": os.environ.get("NORMSWAP_BACKEND"),
    }
    if device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return info


def format_table(rows: list[dict]) -> str:
    """Markdown table: one line per candidate, columns per (shape, dtype) as ``ratio (GB/s)``."""
    configs = list(dict.fromkeys((r["tokens"], r["hidden"], r["dtype"]) for r in rows))
    names = list(dict.fromkeys(r["name"] for r in rows))
    cell = {(r["tokens"], r["hidden"], r["dtype"], r["name"]): r for r in rows}
    head = ["candidate"] + [f"{t}x{h} {d}" for t, h, d in configs]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for n in names:
        cells = [n]
        for cfg in configs:
            r = cell.get((*cfg, n))
            cells.append("" if r is None else f"{r['ratio_to_copy']:.2f}x ({r['gb_per_s']:.1f})")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_results(rows: list[dict], out_dir: str | Path, info: dict | None = None) -> list[Path]:
    """Write ``norm_kernels.json`` and, when matplotlib is installed, ``norm_kernels.png`` to ``out_dir``.

    Returns the paths written.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "norm_kernels.json"
    path.write_text(json.dumps({"machine": info or {}, "results": rows}, indent=2))
    written = [path]
    png = _plot(rows, out / "norm_kernels.png")
    if png is not None:
        written.append(png)
    return written


def _plot(rows: list[dict], path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    configs = list(dict.fromkeys((r["tokens"], r["hidden"], r["dtype"]) for r in rows))
    names = [n for n in dict.fromkeys(r["name"] for r in rows) if n != "copy"]
    ncol = min(3, len(configs))
    nrow = -(-len(configs) // ncol)
    size = (4.5 * ncol + 2.5, 0.3 * len(names) * nrow + 1.5)
    fig, axes = plt.subplots(nrow, ncol, figsize=size, squeeze=False, sharey=True)
    for ax, cfg in zip(axes.flat, configs):
        vals = {r["name"]: r["ratio_to_copy"] for r in rows if (r["tokens"], r["hidden"], r["dtype"]) == cfg}
        ys = [vals.get(n, 0.0) for n in names]
        colors = ["tab:green" if n.startswith("normswap") else "tab:gray" for n in names]
        ax.barh(range(len(names)), ys, color=colors)
        ax.axvline(1.0, color="k", lw=0.8)
        ax.axvline(1.3, color="tab:red", lw=0.8, ls="--")
        ax.set_xscale("log")
        ax.set_yticks(range(len(names)), names)
        ax.set_title(f"[{cfg[0]}, {cfg[1]}] {cfg[2]}")
        ax.set_xlabel("median time / copy (lower is better)")
    axes[0, 0].invert_yaxis()  # shared y: first candidate on top everywhere
    for ax in list(axes.flat)[len(configs) :]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
