"""Launch configurations of the Triton norm kernel, timed side by side per shape (CUDA).

``triton_norm.choose_config`` picks rows per program and warps from the row length and element size; this
sweep times it against alternatives on the kernel table's shapes, so one GPU run shows whether the choice
is the fastest and by how much, per (op, shape, dtype): the previous fixed configuration (``legacy``),
twice and half the rows per tile, twice and half the warps, and a persistent grid (4 programs per
multiprocessor, each looping over tiles with its parameters in registers). Every configuration's output is
compared with the default's (same formula; only the float32 summation order may differ, so at most 1 ulp).

    python -m normswap.bench.sweep --device cuda --out DIR      # what benchmarks/gpu_check.sh runs

Timing: as the kernel grid (``kernels._time_call``): each round one CUDA-event mean of ``CUDA_CALLS``
back-to-back calls per configuration, in a rotating order; median over rounds; the copy of the same tensor
in the same rounds gives the ratio. The launch calls ``triton_norm.norm`` directly with its parameters (no
module, no dispatch), so the numbers are the kernel's and triton's launch path.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

SHAPES = ((16384, 2048), (16384, 4096), (8192, 8192), (32768, 4096))
DTYPES = ("bfloat16", "float16", "float32")
OPS = ("rms_norm llama", "rms_norm gemma", "layer_norm")
PERSISTENT_PER_SM = 4
# Two configurations differ only in the float32 summation order of the row reduction: the normalized value
# may land 1 ulp apart, and in llama order the weight product can add one more (2 ulps, as the CUDA tests
# bound it). More is a wrong kernel.
MAX_ULPS_VS_DEFAULT = 2


def sweep_configs(
    n_rows: int, d: int, itemsize: int, sm_count: int = 132, extended: bool = False, layer: bool = False
) -> dict:
    """label -> ``triton_norm.Config`` for one launch shape: ``default`` (``choose_config``) first, then the
    alternatives, without duplicates (a label whose configuration equals an earlier one is left out).
    ``extended`` adds twice the rows, half the warps and a persistent grid holding its parameters in
    registers (more registers per thread: see ``benchmarks/triton_resources.py``)."""
    from normswap.kernels.triton_norm import MAX_TILE_ROWS, MAX_WARPS, Config, choose_config, legacy_config

    base = choose_config(n_rows, d, itemsize, sm_count, layer=layer)
    tiles = lambda rows: max(1, -(-n_rows // rows))  # noqa: E731
    candidates = {
        "default": base,
        "legacy": legacy_config(n_rows, d),
        "rows /2": Config(base.block_d, max(1, base.rows // 2), base.warps, tiles(max(1, base.rows // 2))),
        "warps x2": Config(base.block_d, base.rows, min(MAX_WARPS, base.warps * 2), base.programs),
        # the same kernel as default (parameters loaded per tile), on a grid of PERSISTENT_PER_SM per SM
        "persistent": base._replace(programs=min(base.programs, sm_count * PERSISTENT_PER_SM)),
    }
    if extended:
        candidates |= {
            "rows x2": Config(
                base.block_d, min(MAX_TILE_ROWS, base.rows * 2), base.warps, tiles(base.rows * 2)
            ),
            "warps /2": Config(base.block_d, base.rows, max(1, base.warps // 2), base.programs),
            "persistent, early": choose_config(
                n_rows, d, itemsize, sm_count, programs_per_sm=PERSISTENT_PER_SM, layer=layer
            ),
        }
    out: dict = {}
    for label, cfg in candidates.items():
        if cfg not in out.values():
            out[label] = cfg
    return out


def _op_call(op: str, x: torch.Tensor, w: torch.Tensor, wg: torch.Tensor, b: torch.Tensor):
    """``config -> output`` for one op on ``x`` with the kernel table's parameters (``kernels.py``)."""
    from normswap.kernels import triton_norm as tn

    if op == "rms_norm llama":
        return lambda cfg: tn.norm(x, None, w, None, 1e-6, "llama", True, 0.0, cfg)[0]
    if op == "rms_norm gemma":
        return lambda cfg: tn.norm(x, None, wg, None, 1e-6, "fp32", True, 1.0, cfg)[0]
    return lambda cfg: tn.norm(x, None, w, b, 1e-5, "fp32", False, 0.0, cfg)[0]


def sweep(
    shapes=SHAPES,
    dtypes=DTYPES,
    ops=OPS,
    rounds: int = 7,
    device: str = "cuda",
    log: Callable[[str], None] | None = None,
    extended: bool = False,
) -> list[dict]:
    """Time every configuration of ``sweep_configs`` (``extended``: its longer list) for every (op, shape,
    dtype).

    On the CPU (no triton launch there) the same code runs in triton's interpreter when
    ``TRITON_INTERPRET=1`` was set before triton was imported (a dry run of tiny shapes: the tests);
    otherwise it raises.

    Returns:
        One dict per (op, shape, dtype, configuration): ``op, tokens, hidden, dtype, label, config``
        (``[block_d, rows, warps, programs, early_params]``), ``median_s``, ``ratio_to_copy``,
        ``ratio_to_default``, ``max_ulps_vs_default`` (largest difference from the default configuration's
        output in ulps of the output dtype: 0 or 1 expected), ``host_s`` (host seconds per call to issue
        it: at ``median_s`` the launch path is the bound).

    Raises:
        ValueError: ``rounds < 1``; RuntimeError: no CUDA device and no interpreter.
    """
    from normswap.bench.kernels import _sync, _time_call

    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("the sweep times triton launches: this torch sees no CUDA device")
        sms = torch.cuda.get_device_properties(dev).multi_processor_count
    else:
        import os

        if os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError("the sweep needs a CUDA device (or TRITON_INTERPRET=1 for a dry run)")
        sms = 1  # the interpreter runs programs one after the other
    out = []
    for tokens, hidden in shapes:
        for dname in dtypes:
            dt = getattr(torch, dname)
            g = torch.Generator(device="cpu").manual_seed(0)
            x = (torch.randn(tokens, hidden, generator=g) * 3).to(dev, dt)
            w = (1.0 + torch.rand(hidden, generator=g) - 0.5).to(dev, dt)
            wg = (torch.rand(hidden, generator=g) - 0.5).to(dev, dt)
            b = (torch.rand(hidden, generator=g) - 0.5).to(dev, dt)
            y = torch.empty_like(x)
            for op in ops:
                configs = sweep_configs(tokens, hidden, dt.itemsize, sms, extended, layer=op == "layer_norm")
                call = _op_call(op, x, w, wg, b)
                cands: dict[str, Callable] = {"copy": lambda x=x, y=y: y.copy_(x)}
                ulps = {}
                want = call(configs["default"])
                spacing = _ulp(want)
                for label, cfg in configs.items():
                    got = call(cfg)  # compiles on first use, before timing
                    _sync(dev)
                    ulps[label] = ((got.double() - want.double()).abs() / spacing).max().item()
                    cands[label] = lambda cfg=cfg, call=call: call(cfg)
                del want, got, spacing
                times: dict[str, list[float]] = {n: [] for n in cands}
                names = list(cands)
                for r in range(rounds):
                    k = r % len(names)
                    for name in names[k:] + names[:k]:
                        times[name].append(_time_call(cands[name], dev))
                med = {n: statistics.median(v) for n, v in times.items()}
                host = {label: _host_time(cands[label], dev) for label in configs}
                for label, cfg in configs.items():
                    out.append(
                        {
                            "op": op,
                            "tokens": tokens,
                            "hidden": hidden,
                            "dtype": dname,
                            "label": label,
                            "config": list(cfg),
                            "median_s": med[label],
                            "ratio_to_copy": med[label] / med["copy"],
                            "ratio_to_default": med[label] / med["default"],
                            "max_ulps_vs_default": ulps[label],
                            "host_s": host[label],
                        }
                    )
                if log is not None:
                    best = min(configs, key=lambda lb: med[lb])
                    base = med["default"] / med["copy"]
                    log(
                        f"sweep {op} [{tokens}, {hidden}] {dname}: default {base:.2f}x of copy "
                        f"({med['default'] * 1e6:.1f} us, host {host['default'] * 1e6:.1f} us to issue), "
                        f"best {best} {med[best] / med['copy']:.2f}x"
                    )
    return out


def _host_time(fn: Callable, dev: torch.device) -> float:
    """Seconds the host spends per call issuing ``CUDA_CALLS`` calls (median of 5 blocks, each after a
    synchronize, without waiting for the GPU): when this reaches the timed per-call time, the launch path,
    not the kernel, sets the pace."""
    from normswap.bench.kernels import CUDA_CALLS, _sync

    cuda = dev.type == "cuda"
    calls = CUDA_CALLS if cuda else 1  # the interpreter's dry run: the path, once
    samples = []
    for _ in range(5 if cuda else 1):
        _sync(dev)
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - t0) / calls)
    _sync(dev)
    return statistics.median(samples)


def _ulp(t: torch.Tensor) -> torch.Tensor:
    """Spacing of ``t``'s dtype at each element's magnitude (float64; at least the smallest normal's)."""
    a = t.abs()
    fin = torch.finfo(t.dtype)
    a = torch.maximum(a, torch.full_like(a, fin.tiny))
    return (torch.nextafter(a, torch.full_like(a, float("inf"))) - a).double()


def format_sweep(rows: list[dict]) -> str:
    """Markdown: one line per (op, shape, dtype), cells ``time / copy (rows r, warps w, e: parameters kept in
    registers / programs p)`` per configuration label, the best marked with ``*``."""
    labels = list(dict.fromkeys(r["label"] for r in rows))
    groups: dict[tuple, dict] = {}
    for r in rows:
        groups.setdefault((r["op"], r["tokens"], r["hidden"], r["dtype"]), {})[r["label"]] = r
    head = ["op, shape, dtype", *labels, "best / default"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (op, t, h, d), cells in groups.items():
        best = min(cells.values(), key=lambda r: r["median_s"])
        row = [f"{op} {t}x{h} {d}"]
        for label in labels:
            r = cells.get(label)
            if r is None:
                row.append("")
                continue
            block, rws, warps, programs, early = r["config"]
            mark = "*" if r is best else ""
            row.append(f"{r['ratio_to_copy']:.2f}x{mark} ({rws}r{warps}w{'e' if early else ''}/{programs}p)")
        row.append(f"{best['ratio_to_default']:.3f} ({best['label']})")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``python -m normswap.bench.sweep [--device cuda] [--out DIR] [--shapes ...] [--dtypes ...]
    [--rounds N] [--extended]``: prints the table and writes ``sweep.json`` and ``sweep.md`` into ``--out``;
    exit 1 when a configuration's output is more than ``MAX_ULPS_VS_DEFAULT`` ulps from the default's, 2 on
    bad arguments or without a CUDA device."""
    import argparse

    from normswap.bench import parse_shapes
    from normswap.files import write_json, write_text

    parser = argparse.ArgumentParser(
        prog="python -m normswap.bench.sweep", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", type=Path, default=Path("normswap-bench"))
    parser.add_argument("--shapes", default=",".join(f"{t}x{h}" for t, h in SHAPES))
    parser.add_argument("--dtypes", default=",".join(DTYPES))
    parser.add_argument("--ops", default=",".join(OPS))
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--extended", action="store_true", help="also the configurations with more registers")
    args = parser.parse_args(argv)
    ops = tuple(o.strip() for o in args.ops.split(",") if o.strip())
    unknown = [o for o in ops if o not in OPS]
    if unknown:
        parser.error(f"unknown op(s) {unknown}; choose from {list(OPS)}")
    try:
        shapes = parse_shapes(args.shapes)
        rows = sweep(shapes, args.dtypes.split(","), ops, args.rounds, args.device, print, args.extended)
    except (ValueError, RuntimeError) as error:
        print(f"sweep: {error}", file=sys.stderr)
        return 2
    table = format_sweep(rows)
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    write_json(args.out / "sweep.json", {"results": rows})
    write_text(args.out / "sweep.md", "# Triton norm launch configurations: time / copy\n\n" + table + "\n")
    print(f"wrote {args.out / 'sweep.json'} and sweep.md")
    off = [r for r in rows if r["max_ulps_vs_default"] > MAX_ULPS_VS_DEFAULT]
    for r in off:
        print(f"sweep: {r['op']} [{r['tokens']}, {r['hidden']}] {r['dtype']} {r['label']}: "
              f"{r['max_ulps_vs_default']:g} ulps from the default configuration's output")  # fmt: skip
    return 1 if off else 0


if __name__ == "__main__":
    sys.exit(main())
