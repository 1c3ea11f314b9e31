"""``normswap bench``: norm kernels and model-level latency, measured side by side.

* ``kernels.py``: the kernel grid, normswap's ops against HF eager modules, torch's norms, a same-size
  copy (the memory roofline) and two compiled floor kernels; CPU and CUDA timing.
* ``decode.py``: per-call cost of whole modules at decode sizes (1-128 rows), side by side, eager and (on
  CUDA) replayed from a CUDA graph.
* ``sweep.py``: launch configurations of the Triton kernel timed side by side (``python -m
  normswap.bench.sweep``).
* ``model.py``: prefill and cached decode of a model, original vs converted, several copies of each.
* ``report.py``: machine info, tables, verdicts against the kernel targets, JSON and PNG.

``run`` is the whole benchmark as ``normswap bench`` and ``benchmarks/bench_norms.py`` run it; method and
measured numbers: docs/KERNELS.md.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from normswap.bench.decode import (
    bench_decode,
    bench_decode_graphs,
    decode_targets,
    format_decode_table,
    format_graph_table,
)
from normswap.bench.kernels import (
    CUDA_CALLS,
    DTYPES,
    FLOOR_ONE_PASS,
    FLOOR_READ,
    SHAPES,
    bench_kernels,
    check_kernel_args,
    default_backends,
    reuse_heap,
)
from normswap.bench.model import bench_model
from normswap.bench.report import (
    CPU_TARGET_RATIO,
    CUDA_TARGET_FRACTION,
    check_targets,
    format_model_table,
    format_table,
    machine_info,
    write_results,
)
from normswap.io.save import check_output_dir

__all__ = [
    "CPU_TARGET_RATIO",
    "CUDA_CALLS",
    "CUDA_TARGET_FRACTION",
    "DTYPES",
    "FLOOR_ONE_PASS",
    "FLOOR_READ",
    "SHAPES",
    "bench_decode",
    "bench_decode_graphs",
    "bench_kernels",
    "bench_model",
    "check_targets",
    "decode_targets",
    "default_backends",
    "format_decode_table",
    "format_graph_table",
    "format_model_table",
    "format_table",
    "machine_info",
    "parse_shapes",
    "reuse_heap",
    "run",
    "write_results",
]


def parse_shapes(text: str) -> tuple[tuple[int, int], ...]:
    """``"16384x2048,8192x4096"`` -> ``((16384, 2048), (8192, 4096))``.

    Raises:
        ValueError: an item that is not ``ROWSxHIDDEN`` with positive integers.
    """
    shapes = []
    for item in text.split(","):
        parts = item.strip().lower().split("x")
        if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise ValueError(f"shape {item.strip()!r} is not ROWSxHIDDEN (positive ints, e.g. 16384x2048)")
        shapes.append((int(parts[0]), int(parts[1])))
    return tuple(shapes)


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
    decode: bool = True,
    model: str | None = None,
    model_rounds: int = 5,
    model_copies: int = 2,
    log: Callable[[str], None] = print,
) -> tuple[list[dict], list[dict], list[Path]]:
    """The whole benchmark, as ``benchmarks/bench_norms.py`` and ``normswap bench`` run it.

    Times the kernel grid (``bench_kernels``) and the per-call cost at decode sizes (``bench_decode``; on
    CUDA also under a CUDA graph, ``bench_decode_graphs``) unless ``kernels`` / ``decode`` is False and, with
    ``model``, the model level (``bench_model``); logs
    progress and the markdown tables through ``log``; writes the results
    into ``out_dir`` (``write_results``).

    Returns:
        ``(kernel rows, model rows, paths written)``.

    Every argument is checked before anything is timed, so a bad one costs no run.

    Raises:
        ValueError: nothing to run (no kernels, no model), ``rounds``/``model_rounds``/``model_copies``/
            ``threads`` below 1, a dtype that is not a floating-point dtype, a device other than cpu or an
            available cuda (or not cpu with ``model``: the model level times on the CPU), an unknown or
            empty list of backends or one the device cannot run (triton off cuda).
        normswap.errors.NormswapError: an ``out_dir`` that is a file, cannot be created or lies in
            ``model`` (see ``normswap.io.check_output_dir``; nothing is created before the results are
            written); ``model`` does not resolve (checked first), or cannot be loaded or converted.
    """
    if not kernels and not model:
        raise ValueError("nothing to run: without the kernel grid (--no-kernels), name a --model to time")
    checks = [("rounds", rounds), ("model_rounds", model_rounds), ("model_copies", model_copies)]
    for name, value in checks + ([("threads", threads)] if threads is not None else []):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    check_kernel_args(device, dtypes, backends)
    if model and torch.device(device).type != "cpu":
        raise ValueError(f"the model-level timing runs on the CPU only; drop --device {device} with --model")
    check_output_dir(out_dir, [model] if model else [], overwrite=True, write_into=True)  # never in the model
    if model:
        from normswap.io.load import resolve

        resolve(model)  # a bad MODEL fails here, not after the kernel grid
    if threads is not None:
        torch.set_num_threads(threads)
    heap = reuse_heap() if heap_reuse else False
    rows, model_rows, decode_rows, graph_rows = [], [], [], []
    if kernels:
        rows = bench_kernels(shapes, dtypes, backends, rounds, device, log=log)
        log(format_table(rows))
        for line in check_targets(rows, device):
            log(f"target {line}")
    if kernels and decode:
        decode_rows = bench_decode(
            dtypes=dtypes,
            backends=backends or default_backends(torch.device(device)),
            rounds=2 * rounds,
            device=device,
        )
        log(format_decode_table(decode_rows))
        for line in decode_targets(decode_rows, device):
            log(f"target {line}")
        if torch.device(device).type == "cuda":
            graph_rows = bench_decode_graphs(
                dtypes=dtypes, backends=backends or default_backends(torch.device(device)), device=device
            )
            log(format_graph_table(graph_rows))
    if model:
        model_rows = bench_model(model, rounds=model_rounds, copies=model_copies, log=log)
        log(format_model_table(model_rows))
    info = machine_info(device, heap)
    info["settings"] = {
        "rounds": rounds if kernels else None,
        "shapes": [list(sh) for sh in shapes] if kernels else [],
        "model_rounds": model_rounds if model else None,
        "model_copies": model_copies if model else None,
    }
    paths = write_results(rows, out_dir, info, model_rows, decode_rows, graph_rows)
    for path in paths:
        log(f"wrote {path}")
    return rows, model_rows, paths
