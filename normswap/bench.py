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

Model level (``bench_model``): prefill and cached greedy decode latency of a model before and after
``normswap.convert`` (fold + swap), timed interleaved in one process.

Entry points: ``bench_kernels`` (returns rows), ``bench_model``, ``format_table``, ``write_results``
(JSON + optional PNG); ``python benchmarks/bench_norms.py`` runs the full grid of the issue.
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


def _candidates(x: torch.Tensor, backends: list[str]) -> dict[str, tuple[Callable, int, str | None]]:
    """name -> (zero-arg callable, bytes it moves, name of the candidate it must agree with or None).

    Weights are random around the identity (``1 + U(-0.5, 0.5)``, Gemma's ``U(-0.5, 0.5)``).
    """
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
    hf_llama, hf_gemma, hf_ln = "HF LlamaRMSNorm", "HF GemmaRMSNorm", "nn.LayerNorm"
    c: dict[str, tuple[Callable, int, str | None]] = {
        "copy": (lambda: y.copy_(x), io, None),
        "clone (alloc+copy)": (lambda: x.clone(), io, None),
        hf_llama: (lambda: llama(x), io, None),
        hf_gemma: (lambda: gemma(x), io, None),
        hf_ln: (lambda: ln(x), io, None),
        "F.rms_norm": (lambda: torch.nn.functional.rms_norm(x, (d,), w, 1e-6), io, hf_llama),
    }
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
        ValueError: unknown dtype name or ``rounds < 1``.
    """
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    _check_kernel_args(device, dtypes, backends)
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


def _prefill(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(ids, use_cache=False).logits


def _decode(model: nn.Module, ids: torch.Tensor, steps: int) -> tuple[list[int], float]:
    """Greedy decode ``steps`` tokens after the prompt with the KV cache.

    Returns the token ids and the seconds the ``steps`` one-token forwards took (prompt excluded).
    """
    out = model(ids, use_cache=True)
    cache, tok, toks = out.cache, out.logits[:, -1:].argmax(-1), []  # transformers 5: "cache"
    t0 = time.perf_counter()
    for _ in range(steps):
        toks.append(int(tok))
        out = model(tok, cache=cache, use_cache=True)
        cache, tok = out.cache, out.logits[:, -1:].argmax(-1)
    return toks, time.perf_counter() - t0


def bench_model(
    source: str = "smollm2-135m",
    prompt_len: int = 512,
    decode_tokens: int = 32,
    rounds: int = 5,
    dtype: str = "float32",
    copies: int = 2,
    log: Callable[[str], None] | None = None,
) -> list[dict]:
    """Latency of the original and the converted model, measured side by side.

    Loads ``source`` (``normswap.io.load_model``), makes ``copies`` deep copies of it as it is and
    ``copies`` converted with ``normswap.convert.convert`` (fold + swap, default options), and times them
    all, rotating which goes first each round: ``prefill`` (one forward over ``1 x prompt_len`` random
    ids, no cache) and ``decode`` (``decode_tokens`` greedy one-token steps with the KV cache after a
    ``1 x 16`` prompt; the prompt's forward is not timed).

    Several copies, because where a model's weights land in memory matters: identical copies of
    SmolLM2-135M differed by up to 18% here. Each row pools its copies' samples; ``copy_medians_s`` shows
    that spread, and a converted/original ratio inside it is noise. (Copies also give every model freshly
    allocated, aligned weights: GGUF-loaded ones can sit at 16-byte offsets, which alone slowed decode.)

    Returns:
        One dict per (phase, model in ``"original"``, ``"converted"``): ``phase, model, median_s`` (over
        all copies and rounds), ``copy_medians_s``, ``ratio_to_original``, ``tokens_agree`` (decode:
        whether every copy produced the original's greedy tokens).

    Raises:
        ValueError: ``rounds`` or ``copies`` below 1.
        normswap.errors.NormswapError: the model cannot be loaded or converted.
    """
    import copy

    from normswap.convert import convert
    from normswap.io import load_model

    for name, value in (("rounds", rounds), ("copies", copies)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    loaded = load_model(source, dtype=dtype, tokenizer=False).model
    models = {}
    for i in range(copies):
        models[("original", i)] = copy.deepcopy(loaded)
    for i in range(copies):
        models[("converted", i)] = convert_copy = copy.deepcopy(loaded)
        convert(convert_copy)
    del loaded
    vocab = models[("original", 0)].config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, vocab, (1, prompt_len), generator=g)
    short = torch.randint(0, vocab, (1, 16), generator=g)
    times = {(ph, key): [] for ph in ("prefill", "decode") for key in models}
    tokens = {}
    with torch.inference_mode():
        for key, m in models.items():  # warm-up
            _prefill(m, prompt)
            tokens[key] = _decode(m, short, decode_tokens)[0]
        keys = list(models)
        for r in range(rounds):
            k = r % len(keys)
            for key in keys[k:] + keys[:k]:
                t0 = time.perf_counter()
                _prefill(models[key], prompt)
                times[("prefill", key)].append(time.perf_counter() - t0)
                times[("decode", key)].append(_decode(models[key], short, decode_tokens)[1])
            if log is not None:
                log(f"model round {r + 1}/{rounds}")
    rows = []
    for phase in ("prefill", "decode"):
        pooled = {
            v: [t for i in range(copies) for t in times[(phase, (v, i))]] for v in ("original", "converted")
        }
        base = statistics.median(pooled["original"])
        for v in ("original", "converted"):
            med = statistics.median(pooled[v])
            rows.append(
                {
                    "phase": phase,
                    "model": v,
                    "source": source,
                    "prompt_len": prompt_len if phase == "prefill" else 16,
                    "decode_tokens": decode_tokens if phase == "decode" else 0,
                    "median_s": med,
                    "copy_medians_s": [statistics.median(times[(phase, (v, i))]) for i in range(copies)],
                    "ratio_to_original": med / base,
                    "tokens_agree": all(tokens[(v, i)] == tokens[("original", 0)] for i in range(copies)),
                }
            )
    return rows


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def machine_info(device: str = "cpu", heap_reuse: bool | None = None) -> dict:
    """What the numbers were measured on."""
    info = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "processor": _cpu_model(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),  # ATen's vector ISA (AVX2, AVX512...)
        "cpu_bf16_instructions": _cpu_flags() >= {"avx512_bf16"},
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "device": device,
        "heap_reuse": heap_reuse,
        "backend_env": os.environ.get("NORMSWAP_BACKEND"),
        # other processes' load distorts absolute numbers; interleaving keeps the ratios comparable
        "load_avg_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
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


# The targets of the kernel issue, as ratios measured in one run (docs/KERNELS.md): on a CPU, normswap's
# norms within 1.3x of the copy's time at [16384, 2048]; on CUDA, in bfloat16 at hidden >= 2048, at
# least 80% of the copy's bandwidth and faster than torch's own F.rms_norm.
CPU_TARGET_RATIO = 1.3
CUDA_TARGET_FRACTION = 0.8


def check_targets(rows: list[dict], device: str) -> list[str]:
    """One verdict line per normswap op (``rms_norm llama``, ``rms_norm gemma``, ``layer_norm``) and
    configuration a target covers: its fastest backend's measured ratio, the target, and ``met``/``missed``.

    ``rows`` are ``bench_kernels`` rows measured on ``device``. A user can force any backend, so an op meets
    a target when one of its backends does; the line names that backend. Configurations no target covers
    are skipped (an empty list when none is covered).
    """
    best: dict[tuple, dict] = {}
    for r in rows:
        if r["name"].startswith("normswap"):
            key = (r["tokens"], r["hidden"], r["dtype"], r["name"].rsplit(" [", 1)[0])
            if key not in best or r["median_s"] < best[key]["median_s"]:
                best[key] = r
    cell = {(r["tokens"], r["hidden"], r["dtype"], r["name"]): r for r in rows}
    lines = []
    for (tokens, hidden, dtype, _), r in best.items():
        where = f"[{tokens}, {hidden}] {dtype} {r['name']}"
        if not device.startswith("cuda"):
            if (tokens, hidden) == (16384, 2048):
                ok = r["ratio_to_copy"] <= CPU_TARGET_RATIO
                target = f"<= {CPU_TARGET_RATIO}x"
                lines.append(f"{where}: {r['ratio_to_copy']:.2f}x of copy (target {target}): {_met(ok)}")
            continue
        if dtype != "bfloat16" or hidden < 2048:
            continue
        fraction = 1.0 / r["ratio_to_copy"]
        line = f"{where}: {fraction:.0%} of copy bandwidth (target >= {CUDA_TARGET_FRACTION:.0%})"
        ok = fraction >= CUDA_TARGET_FRACTION
        torch_rms = cell.get((tokens, hidden, dtype, "F.rms_norm"))
        if "rms_norm" in r["name"] and torch_rms is not None:
            speedup = torch_rms["median_s"] / r["median_s"]
            line += f", {speedup:.2f}x the speed of F.rms_norm (target > 1)"
            ok = ok and speedup > 1.0
        lines.append(f"{line}: {_met(ok)}")
    return lines


def _met(ok: bool) -> str:
    return "met" if ok else "missed"


def format_model_table(rows: list[dict]) -> str:
    """Markdown table of ``bench_model`` rows."""
    head = "| phase | model | median ms | vs original | median ms of each copy | same greedy tokens |"
    lines = [head, "|---|---|---|---|---|---|"]
    for r in rows:
        each = ", ".join(f"{t * 1e3:.1f}" for t in r["copy_medians_s"])
        lines.append(
            f"| {r['phase']} | {r['model']} | {r['median_s'] * 1e3:.1f} | {r['ratio_to_original']:.3f}x "
            f"| {each} | {'yes' if r['tokens_agree'] else 'NO'} |"
        )
    return "\n".join(lines)


def write_results(
    rows: list[dict], out_dir: str | Path, info: dict | None = None, model_rows: list[dict] | None = None
) -> list[Path]:
    """Write ``norm_kernels.json`` (kernel rows, machine info, the ``check_targets`` lines for
    ``info["device"]``, model rows if any) and, when matplotlib is installed, ``norm_kernels.png`` into
    ``out_dir`` (created if missing).

    Returns the paths written.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "norm_kernels.json"
    info = info or {}
    targets = check_targets(rows, info.get("device", "cpu"))
    doc = {"machine": info, "results": rows, "targets": targets, "model": model_rows or []}
    path.write_text(json.dumps(doc, indent=2))
    written = [path]
    png = _plot(rows, out / "norm_kernels.png")
    if png is not None:
        written.append(png)
    return written


def run(
    out_dir: str | Path,
    *,
    device: str = "cpu",
    shapes=SHAPES,
    dtypes=DTYPES,
    backends: list[str] | None = None,
    rounds: int = 15,
    heap_reuse: bool = True,
    threads: int | None = None,
    kernels: bool = True,
    model: str | None = None,
    model_rounds: int = 5,
    model_copies: int = 2,
    log: Callable[[str], None] = print,
) -> tuple[list[dict], list[dict], list[Path]]:
    """The whole benchmark, as ``benchmarks/bench_norms.py`` and ``normswap bench`` run it.

    Times the kernel grid (``bench_kernels``) unless ``kernels`` is False and, with ``model``, the model
    level (``bench_model``); logs progress and the markdown tables through ``log``; writes the results
    into ``out_dir`` (``write_results``).

    Returns:
        ``(kernel rows, model rows, paths written)``.

    Every argument is checked before anything is timed, so a bad one costs no run.

    Raises:
        ValueError: nothing to run (no kernels, no model), ``rounds``/``model_rounds``/``model_copies``/
            ``threads`` below 1, a dtype that is not a floating-point dtype, a device other than cpu or an
            available cuda, an unknown backend or one the device cannot run (triton off cuda), ``out_dir``
            not a creatable directory.
        normswap.errors.NormswapError: ``model`` does not resolve (checked first), or cannot be loaded or
            converted.
    """
    if not kernels and not model:
        raise ValueError("nothing to run: without the kernel grid, name a model to time")
    checks = [("rounds", rounds), ("model_rounds", model_rounds), ("model_copies", model_copies)]
    for name, value in checks + ([("threads", threads)] if threads is not None else []):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if kernels:
        _check_kernel_args(device, dtypes, backends)
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise ValueError(f"{out}: not a directory") from None
    except OSError as error:
        raise ValueError(f"cannot create {out}: {error.strerror or error}") from None
    if model:
        from normswap.io.load import resolve

        resolve(model)  # a bad MODEL fails here, not after the kernel grid
    if threads is not None:
        torch.set_num_threads(threads)
    heap = reuse_heap() if heap_reuse else False
    rows, model_rows = [], []
    if kernels:
        rows = bench_kernels(shapes, dtypes, backends, rounds, device, log=log)
        log(format_table(rows))
        for line in check_targets(rows, device):
            log(f"target {line}")
    if model:
        model_rows = bench_model(model, rounds=model_rounds, copies=model_copies, log=log)
        log(format_model_table(model_rows))
    info = machine_info(device, heap)
    info["settings"] = {"rounds": rounds, "shapes": [list(sh) for sh in shapes] if kernels else [],
                        "model_rounds": model_rounds if model else None,
                        "model_copies": model_copies if model else None}  # fmt: skip
    paths = write_results(rows, out_dir, info, model_rows)
    for path in paths:
        log(f"wrote {path}")
    return rows, model_rows, paths


def _check_kernel_args(device: str, dtypes, backends: list[str] | None) -> None:
    """The kernel grid's arguments, checked before any timing (see ``run``)."""
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

    for be in backends or []:
        resolve_backend(be)
        if be == "triton" and be not in default_backends(dev):
            raise ValueError(f"the triton backend runs on cuda with triton installed, not on {device!r}")


def _plot(rows: list[dict], path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        return None
    configs = list(dict.fromkeys((r["tokens"], r["hidden"], r["dtype"]) for r in rows))
    names = [n for n in dict.fromkeys(r["name"] for r in rows) if n != "copy"]
    ncol = min(3, len(configs))
    nrow = -(-len(configs) // ncol)
    size = (4.5 * ncol + 2.5, 0.3 * len(names) * nrow + 1.5)
    fig, axes = plt.subplots(nrow, ncol, figsize=size, squeeze=False, sharey=True)
    for ax, cfg in zip(axes.flat, configs, strict=False):
        vals = {r["name"]: r["ratio_to_copy"] for r in rows if (r["tokens"], r["hidden"], r["dtype"]) == cfg}
        ys = [vals.get(n, 0.0) for n in names]
        colors = ["tab:green" if n.startswith("normswap") else "tab:gray" for n in names]
        ax.barh(range(len(names)), ys, color=colors)
        ax.axvline(1.0, color="k", lw=0.8)
        ax.axvline(1.3, color="tab:red", lw=0.8, ls="--")
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%gx"))
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
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
