"""What the Triton norm kernel compiles to on a Hopper GPU, read without one.

    python benchmarks/triton_resources.py           # the kernel table's shapes, every op and dtype
    python benchmarks/triton_resources.py --shapes 16384x2048 --sweep

Triton's wheel carries ptxas and cuobjdump, so ``triton.compile`` builds the cubin for ``--arch`` (90:
H100/H200) on any machine. For every (op, dtype, shape) and launch configuration (``choose_config``; with
``--sweep`` also the alternatives ``normswap.bench.sweep`` times on a GPU) this prints the registers per
thread, the local memory (spills: must be 0), the 16-byte global loads and stores (vectorized: ``LDG.E.128``)
against the narrower ones, and whether loads are staged through shared memory (``LDGSTS``, cp.async). The
kernel is specialized as the JIT specializes it at a launch: 16-byte aligned pointers and a row length
divisible by 16 carry triton's divisibility hint, so the load width seen here is the one the GPU runs.
"""

from __future__ import annotations

import collections
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import click

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

OPS = {  # name -> constexpr flags of _norm_kernel (cast order, weight, bias, offset)
    "rms_norm llama": dict(IS_RMS=True, LLAMA=True, HAS_W=True, HAS_B=False, HAS_OFFSET=False),
    "rms_norm gemma": dict(IS_RMS=True, LLAMA=False, HAS_W=True, HAS_B=False, HAS_OFFSET=True),
    "layer_norm": dict(IS_RMS=False, LLAMA=False, HAS_W=True, HAS_B=True, HAS_OFFSET=False),
}
_TYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
_POINTERS = ("X", "R", "W", "B", "Y", "HOUT")


def resources(op: str, dtype: str, d: int, config, arch: int = 90, extra: dict | None = None) -> dict:
    """Compile ``_norm_kernel`` for ``op`` (a key of ``OPS``), input/parameter ``dtype`` and rows of ``d``
    elements with ``config`` (``triton_norm.Config``) for ``sm_{arch}``; read the cubin with cuobjdump.
    ``extra`` overrides constexpr flags (``HAS_RES``, ``PER_HEAD``, ...).

    Returns:
        ``{"registers", "local_bytes", "shared_bytes", "ldg128", "ldg_narrow", "stg128", "stg_narrow",
        "ldgsts"}`` (counts of SASS instructions, bytes).
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from normswap.kernels import triton_norm as tn

    flags = dict(
        OPS[op],
        HAS_RES=False,
        PER_HEAD=False,
        EARLY_PARAMS=config.early_params,
        ROWS=config.rows,
        BLOCK_D=config.block_d,
    )
    flags.update(extra or {})
    signature, attrs = {}, {}
    for i, name in enumerate(tn._norm_kernel.arg_names):
        if name in flags:
            signature[name] = "constexpr"
        elif name in _POINTERS:
            signature[name] = "*" + _TYPES[dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]  # torch's allocations are 256-byte aligned
        elif name in ("eps", "offset"):
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
            if name == "D" and d % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=tn._norm_kernel, signature=signature, constexprs=flags, attrs=attrs)
    kernel = triton.compile(
        src,
        target=GPUTarget("cuda", arch, 32),
        options={"num_warps": config.warps, "enable_fp_fusion": False},
    )
    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "k.cubin")
        Path(cubin).write_bytes(kernel.asm["cubin"])
        usage = subprocess.run([tools / "cuobjdump", "--dump-resource-usage", cubin], capture_output=True,
                               text=True, check=True).stdout  # fmt: skip
        sass = subprocess.run([tools / "cuobjdump", "--dump-sass", cubin], capture_output=True, text=True,
                              check=True).stdout  # fmt: skip
    ops = collections.Counter(re.findall(r"\b(LDGSTS|LDG|STG)\.E((?:\.\w+)*)", sass))
    wide = lambda kind: sum(n for (k, mods), n in ops.items() if k == kind and ".128" in mods)  # noqa: E731
    narrow = lambda kind: sum(n for (k, mods), n in ops.items() if k == kind and ".128" not in mods)  # noqa: E731
    field = lambda name: int(re.search(rf"\b{name}:(\d+)", usage).group(1))  # noqa: E731
    return {
        "registers": field("REG"),
        "local_bytes": field("LOCAL"),
        "shared_bytes": field("SHARED"),
        "ldg128": wide("LDG"),
        "ldg_narrow": narrow("LDG"),
        "stg128": wide("STG"),
        "stg_narrow": narrow("STG"),
        "ldgsts": sum(n for (k, _), n in ops.items() if k == "LDGSTS"),
    }


def resident_programs(registers: int, warps: int) -> int:
    """Programs one Hopper multiprocessor holds at once, from registers per thread and warps per program:
    65536 registers allocated per warp in units of 256, at most 64 warps and 32 programs (CUDA's occupancy
    rules for compute capability 9.0; shared memory is not the limit for this kernel). Times the tile's bytes,
    this is the input a multiprocessor can have in flight: the lever of a memory-bound kernel."""
    per_warp = -(-registers * 32 // 256) * 256
    return max(0, min(32, 64 // warps, 65536 // (per_warp * warps)))


@click.command()
@click.option("--shapes", default="16384x2048,16384x4096,8192x8192,32768x4096", show_default=True)
@click.option("--dtypes", default="bfloat16,float16,float32", show_default=True)
@click.option("--ops", "op_names", default=",".join(OPS), show_default=True)
@click.option("--sweep", is_flag=True, help="Also the alternative configurations the GPU sweep times.")
@click.option("--arch", type=int, default=90, show_default=True)
def main(shapes, dtypes, op_names, sweep, arch):
    """Registers, spills and load widths of the Triton norm kernel per configuration (no GPU needed)."""
    import torch

    from normswap.bench import parse_shapes
    from normswap.bench.sweep import sweep_configs

    print("| op | dtype | shape | config | regs | local B | LDG.128 / narrow | STG.128 / narrow | LDGSTS "
          "| programs / SM | resident KiB / SM |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    seen = set()
    for rows, d in parse_shapes(shapes):
        for dtype in dtypes.split(","):
            itemsize = getattr(torch, dtype).itemsize
            for op in op_names.split(","):
                configs = sweep_configs(rows, d, itemsize, extended=True, layer=op == "layer_norm")
                if not sweep:
                    configs = {"default": configs["default"]}
                for label, cfg in configs.items():
                    key = (op, dtype, d, cfg.block_d, cfg.rows, cfg.warps, cfg.early_params)
                    if key in seen:  # the grid size does not change the code
                        continue
                    seen.add(key)
                    r = resources(op, dtype, d, cfg, arch)
                    per_sm = resident_programs(r["registers"], cfg.warps)
                    kib = per_sm * cfg.rows * cfg.block_d * itemsize / 1024
                    name = f"{label} {cfg.rows}r{cfg.warps}w" + ("e" if cfg.early_params else "")
                    cells = [op, dtype, f"{rows}x{d}", name, r["registers"], r["local_bytes"],
                             f"{r['ldg128']} / {r['ldg_narrow']}", f"{r['stg128']} / {r['stg_narrow']}",
                             r["ldgsts"], per_sm, f"{kib:.0f}"]  # fmt: skip
                    print("| " + " | ".join(map(str, cells)) + " |", flush=True)


if __name__ == "__main__":
    main()
