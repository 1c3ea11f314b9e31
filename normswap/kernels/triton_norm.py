"""Triton backend (CUDA): one kernel for RMSNorm, LayerNorm and residual-add + RMSNorm.

Imported lazily by ``ops.py`` only for CUDA tensors when triton is installed. Each program holds a tile of
``ROWS`` rows of ``BLOCK_D >= D`` columns in registers, reduces each row in float32 and writes the output
once, so memory traffic is one read of ``x`` (and ``residual``) and one write of ``y`` (and
``x + residual``): the bound of a same-size copy. The parameters of a ``(D,)`` norm are read once per
program and reused for every tile it processes. Rows of ``D`` above ``MAX_D`` go to the torch backend.

Launch configuration (``choose_config``, a pure function of rows, row length and element size): each
thread holds about ``THREAD_BYTES`` of input, enough independent 16-byte loads in flight to cover memory
latency, and a program moves about ``TILE_BYTES``: short rows are packed several to a program (which also
amortizes the parameter loads), long rows get more warps. Small launches (decode steps) are spread over
more programs instead.

Numerics follow ``reference.py`` step by step, including every rounding torch performs:
``x + residual`` is rounded to its promoted dtype before normalizing; in ``"llama"`` order the normalized
value is rounded to the input dtype before the weight multiply, and the weight product is rounded to the
output dtype before a bias is added; the offset of ``(offset + w)`` is added as ``prepare_params`` does
(in the weight's dtype for ``"llama"``, in float32 for ``"fp32"``), inside the kernel. A product of two
half/bfloat16 values is exact in float32, so one rounding at the store reproduces torch's elementwise
multiply. What differs from torch is only the float32 summation order of the row reduction (and rsqrt's
last bit), i.e. at most 1 ulp of the output on rare elements; the tile shape changes which lanes sum which
elements, not what is rounded.

The kernel can be checked without a GPU in triton's interpreter (``TRITON_INTERPRET=1`` set before this
module is imported; CPU tensors), which ``tests/test_kernels.py`` does for every configuration kind.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from normswap.kernels.reference import output_dtype

MAX_D = 65536


@triton.jit
def _weight(p, offset, LLAMA: tl.constexpr, HAS_OFFSET: tl.constexpr):
    """Loaded weight values as float32, with ``offset + w`` rounded as ``reference.prepare_params`` rounds
    it (``p`` keeps the weight's dtype until here: half the registers of float32 while it waits)."""
    if HAS_OFFSET:
        if LLAMA:  # offset + w in the weight's dtype (torch: float32 add, one rounding to that dtype)
            p = (p.to(tl.float32) + offset).to(p.dtype)
        else:  # offset + w.float()
            p = p.to(tl.float32) + offset
    return p.to(tl.float32)


@triton.jit(do_not_specialize=["n_rows", "W_ROWS", "B_ROWS"])
def _norm_kernel(
    X,
    R,
    W,
    B,
    Y,
    HOUT,
    n_rows,
    D,
    W_ROWS,
    B_ROWS,
    eps,
    offset,
    IS_RMS: tl.constexpr,
    LLAMA: tl.constexpr,
    HAS_W: tl.constexpr,
    HAS_B: tl.constexpr,
    HAS_RES: tl.constexpr,
    PER_HEAD: tl.constexpr,
    HAS_OFFSET: tl.constexpr,
    EARLY_PARAMS: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    cols = tl.arange(0, BLOCK_D)
    col_ok = cols < D
    # (D,) parameters with EARLY_PARAMS (a persistent grid): loaded once per program, kept in registers for
    # every tile it normalizes. Otherwise they are loaded after the row reduction, when the input's float32
    # copy is no longer live (fewer registers per thread, more programs per multiprocessor).
    if HAS_W and EARLY_PARAMS and not PER_HEAD:
        w_row = tl.load(W + cols, mask=col_ok, other=0.0)[None, :]
    if HAS_B and EARLY_PARAMS and not PER_HEAD:
        b_row = tl.load(B + cols, mask=col_ok, other=0.0)[None, :]
    # One tile per program unless the grid is smaller than the number of tiles (a persistent grid).
    for tile in tl.range(tl.program_id(0), tl.cdiv(n_rows, ROWS), tl.num_programs(0)):
        rows = tile * ROWS + tl.arange(0, ROWS)
        mask = (rows < n_rows)[:, None] & col_ok[None, :]
        offs = rows.to(tl.int64)[:, None] * D + cols[None, :]

        x = tl.load(X + offs, mask=mask, other=0.0)
        if HAS_RES:
            # torch's x + residual: computed in float32, rounded to the promoted dtype, which is also the
            # dtype the "llama" order rounds the normalized value to.
            h = (x.to(tl.float32) + tl.load(R + offs, mask=mask, other=0.0).to(tl.float32)).to(
                HOUT.dtype.element_ty
            )
            tl.store(HOUT + offs, h, mask=mask)
            xf = h.to(tl.float32)
        else:
            xf = x.to(tl.float32)

        if IS_RMS:
            ms = tl.sum(xf * xf, axis=1) / D
            n = xf * tl.math.rsqrt(ms + eps)[:, None]
        else:
            mean = tl.sum(xf, axis=1) / D
            xc = tl.where(mask, xf - mean[:, None], 0.0)
            var = tl.sum(xc * xc, axis=1) / D
            n = xc * tl.math.rsqrt(var + eps)[:, None]

        if LLAMA:
            if HAS_RES:
                n = n.to(HOUT.dtype.element_ty).to(tl.float32)
            else:
                n = n.to(X.dtype.element_ty).to(tl.float32)
        y = n
        if HAS_W:
            if PER_HEAD:  # (H, D) weight: row r of x meets weight row r % H
                w_offs = (rows % W_ROWS).to(tl.int64)[:, None] * D + cols[None, :]
                wv = tl.load(W + w_offs, mask=mask, other=0.0)
            elif EARLY_PARAMS:
                wv = w_row
            else:
                wv = tl.load(W + cols, mask=col_ok, other=0.0)[None, :]
            y = y * _weight(wv, offset, LLAMA, HAS_OFFSET)
        if HAS_B:
            if LLAMA and HAS_W:
                y = y.to(Y.dtype.element_ty).to(tl.float32)
            if PER_HEAD:
                b_offs = (rows % B_ROWS).to(tl.int64)[:, None] * D + cols[None, :]
                bv = tl.load(B + b_offs, mask=mask, other=0.0)
            elif EARLY_PARAMS:
                bv = b_row
            else:
                bv = tl.load(B + cols, mask=col_ok, other=0.0)[None, :]
            y = y + bv.to(tl.float32)
        tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------------------------------------------------
# Launch configuration.


class Config(NamedTuple):
    """How one launch covers ``n_rows`` rows of ``d`` elements.

    ``block_d``: the power of two covering the row (masked beyond ``d``); ``rows``: rows per tile (a power
    of two); ``warps``: warps per program; ``programs``: the grid. A program normalizes tiles ``pid,
    pid + programs, ...``, so ``programs`` equal to the number of tiles is one tile per program and a smaller
    grid is persistent. ``early_params``: a ``(D,)`` weight and bias are loaded before the first tile and
    kept in registers (worth it when a program normalizes several tiles), else after each tile's reduction.
    """

    block_d: int
    rows: int
    warps: int
    programs: int
    early_params: bool = False


# Input bytes per thread (8 loads of 16 bytes in flight, 64 bfloat16 / 32 float32 values) and per program.
# Memory latency is covered when each multiprocessor has tens of KiB of loads in flight (Little's law at
# ~4.8 TB/s over 132 multiprocessors); a tile of one 2048-element bfloat16 row per 8-warp program holds only
# 16 bytes per thread. The same shape as quack's Hopper RMSNorm (about 64 elements per thread, 128-thread
# blocks holding several short rows, more threads per row for long rows).
THREAD_BYTES = 128
TILE_BYTES = 16384
MAX_TILE_ROWS = 128
MAX_WARPS = 32
# Launches with fewer tiles than this many per multiprocessor use smaller tiles (more programs).
MIN_TILES_PER_SM = 2
DEFAULT_SMS = 132  # H100 SXM / H200; the launch reads the real count


@functools.lru_cache(maxsize=4096)
def choose_config(
    n_rows: int,
    d: int,
    itemsize: int,
    sm_count: int = DEFAULT_SMS,
    tile_bytes: int = TILE_BYTES,
    thread_bytes: int = THREAD_BYTES,
    programs_per_sm: int = 0,
    layer: bool = False,
) -> Config:
    """The launch configuration for ``n_rows`` rows of ``d`` elements of ``itemsize`` bytes (the input's).

    * Rows of at least ``tile_bytes`` (padded to a power of two): one row per tile and
      ``row bytes / (32 * thread_bytes)`` warps (at least 4, at most 32): ``thread_bytes`` per thread, half
      that for LayerNorm (``layer``), whose centered copy of the row takes more registers per element
      (sm_90, 8192 bfloat16 values: 167 registers at 64 per thread, 3 programs per multiprocessor; 64 at 32,
      4 programs).
    * Shorter rows: ``tile_bytes // row bytes`` rows per tile (at most ``MAX_TILE_ROWS``), 4 warps; halved
      while the launch would have fewer than ``MIN_TILES_PER_SM`` tiles per multiprocessor, so decode-sized
      calls spread over the chip; fewer warps when a tile holds less than one 16-byte vector per thread.
    * ``programs_per_sm`` > 0 caps the grid at ``sm_count * programs_per_sm`` (persistent, parameters loaded
      once per program); 0: one tile per program, parameters loaded after the reduction (fewer registers:
      measured with ptxas for sm_90, 64-240 registers per thread early vs 63-167 late at the table's shapes,
      ``benchmarks/triton_resources.py``).

    Pure (cached): the benchmark sweeps its knobs, ``tests/test_kernels.py`` pins its choices.

    Raises:
        ValueError: ``d`` outside ``1..MAX_D``, negative ``n_rows``, or a non-positive size knob.
    """
    if not 1 <= d <= MAX_D:
        raise ValueError(f"rows must have 1..{MAX_D} elements, got {d}")
    if n_rows < 0 or itemsize < 1 or sm_count < 1 or tile_bytes < 16 or thread_bytes < 16:
        raise ValueError(f"bad launch sizes: {n_rows=} {itemsize=} {sm_count=} {tile_bytes=} {thread_bytes=}")
    block = triton.next_power_of_2(d)
    row_bytes = block * itemsize
    if row_bytes >= tile_bytes:
        rows = 1
        per_thread = thread_bytes // 2 if layer else thread_bytes
        warps = max(4, min(MAX_WARPS, row_bytes // (32 * per_thread)))
    else:
        rows = max(1, min(MAX_TILE_ROWS, tile_bytes // row_bytes))
        while rows > 1 and triton.cdiv(n_rows, rows) < MIN_TILES_PER_SM * sm_count:
            rows //= 2
        warps = max(1, min(4, rows * row_bytes // (32 * 16)))
    tiles = max(1, triton.cdiv(n_rows, rows))
    programs = tiles if programs_per_sm <= 0 else min(tiles, sm_count * programs_per_sm)
    return Config(block, rows, warps, programs, programs < tiles)


def legacy_config(n_rows: int, d: int) -> Config:
    """The configuration before per-shape choice (kept for the benchmark's sweep, as the baseline): one row
    per program from 1024 columns, warps by Liger-Kernel's thresholds (4; 8 from 2048; 16 from 8192; 32
    from 32768); shorter rows packed ``2048 // BLOCK_D`` to a program (at most 64), 4 warps."""
    block = triton.next_power_of_2(d)
    if block >= 1024:
        rows, warps = 1, (32 if block >= 32768 else 16 if block >= 8192 else 8 if block >= 2048 else 4)
    else:
        rows, warps = max(1, min(64, 2048 // block)), 4
    return Config(block, rows, warps, max(1, triton.cdiv(n_rows, rows)))


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _device_sms(device: torch.device) -> int:
    if device.type != "cuda":  # triton's interpreter (CPU tensors)
        return DEFAULT_SMS
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


# Launch metadata per (row length, dtypes, parameter shapes, flags): output dtypes and the kernel's
# constant arguments, so a repeated call computes only its configuration (cached too) before launching.
# Bounded by the distinct norm configurations of the models in a process.
_LAUNCH_CACHE: dict[tuple, tuple] = {}


def _plan(
    d: int,
    x_dtype: torch.dtype,
    r_dtype: torch.dtype | None,
    w_shape: tuple | None,
    w_dtype: torch.dtype | None,
    b_shape: tuple | None,
    b_dtype: torch.dtype | None,
    cast_order: str,
    is_rms: bool,
    has_offset: bool,
) -> tuple:
    key = (d, x_dtype, r_dtype, w_shape, w_dtype, b_shape, b_dtype, cast_order, is_rms, has_offset)
    plan = _LAUNCH_CACHE.get(key)
    if plan is None:
        hdt = x_dtype if r_dtype is None else torch.promote_types(x_dtype, r_dtype)
        # The effective weight's dtype (prepare_params): float32 in "fp32" order.
        eff_w = None if w_dtype is None else (torch.float32 if cast_order == "fp32" else w_dtype)
        eff_b = None if b_dtype is None else (torch.float32 if cast_order == "fp32" else b_dtype)
        ydt = output_dtype(hdt, eff_w, eff_b, cast_order)
        w_rows = 1 if w_shape is None else math.prod(w_shape) // d
        b_rows = 1 if b_shape is None else math.prod(b_shape) // d
        meta = {
            "IS_RMS": is_rms,
            "LLAMA": cast_order == "llama",
            "HAS_W": w_shape is not None,
            "HAS_B": b_shape is not None,
            "HAS_RES": r_dtype is not None,
            "PER_HEAD": w_rows > 1 or b_rows > 1,
            "HAS_OFFSET": has_offset,
            # No FMA contraction: in "llama" order ``w * n`` is rounded to the output dtype before ``+ b``, as
            # torch does in two kernels; with contraction on (triton's default) the multiply and the add
            # became one fma with one rounding. Measured on an H200 (triton 3.6), llama-order LayerNorm
            # against the eager reference: 30% of the elements differed (up to 254 ulps where w * n cancels
            # b), under 0.01% without. Kernel time unchanged within the run-to-run spread.
            "enable_fp_fusion": False,
        }
        plan = _LAUNCH_CACHE[key] = (hdt, ydt, w_rows, b_rows, meta)
    return plan


def norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    w: torch.Tensor | None,
    b: torch.Tensor | None,
    eps: float,
    cast_order: str,
    is_rms: bool,
    offset: float = 0.0,
    config: Config | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One launch of the kernel: ``(y, x + residual or None)``.

    Args:
        x: ``(..., D)`` input, ``D <= MAX_D``; residual: same shape or None.
        w, b: the module's own parameters, ``(D,)`` or per-head ``(H, D)``, or None; ``offset`` is added to
            ``w`` in the kernel as ``reference.prepare_params`` adds it.
        eps, cast_order: as in ``reference.py``; ``is_rms``: RMSNorm (else LayerNorm).
        config: a launch configuration (the benchmark's sweep); default ``choose_config``.

    Raises:
        ValueError: ``D > MAX_D``, or a ``config`` whose ``block_d`` does not cover ``D``.
    """
    d = x.shape[-1]
    if d > MAX_D:
        raise ValueError(f"triton norm supports rows of at most {MAX_D} elements, got {d}")
    x = x.contiguous()
    n_rows = x.numel() // d if d else 0
    hdt, ydt, w_rows, b_rows, meta = _plan(
        d,
        x.dtype,
        None if residual is None else residual.dtype,
        None if w is None else tuple(w.shape),
        None if w is None else w.dtype,
        None if b is None else tuple(b.shape),
        None if b is None else b.dtype,
        cast_order,
        is_rms,
        w is not None and offset != 0.0,
    )
    y = torch.empty(x.shape, dtype=ydt, device=x.device)
    h = None if residual is None else torch.empty(x.shape, dtype=hdt, device=x.device)
    if n_rows == 0:
        return y, h
    if config is None:
        config = choose_config(n_rows, d, x.element_size(), _device_sms(x.device), layer=not is_rms)
    elif config.block_d < d:
        raise ValueError(f"config {config} does not cover rows of {d} elements")
    w_c = None if w is None else w.contiguous()
    b_c = None if b is None else b.contiguous()
    _norm_kernel[(config.programs,)](
        x,
        x if residual is None else residual.contiguous(),
        x if w_c is None else w_c,
        x if b_c is None else b_c,
        y,
        y if h is None else h,
        n_rows,
        d,
        w_rows,
        b_rows,
        eps,
        float(offset),
        EARLY_PARAMS=config.early_params,
        ROWS=config.rows,
        BLOCK_D=config.block_d,
        num_warps=config.warps,
        **meta,
    )
    return y, h


def rms_norm(
    x: torch.Tensor, w: torch.Tensor | None, eps: float, cast_order: str, offset: float = 0.0
) -> torch.Tensor:
    """Triton ``reference.rms_norm_math``: ``x`` (..., D) on CUDA; ``w`` the module's weight or None (with
    ``offset`` the weight is ``offset + w``, as ``prepare_params`` makes it)."""
    return norm(x, None, w, None, eps, cast_order, True, offset)[0]


def layer_norm(
    x: torch.Tensor,
    w: torch.Tensor | None,
    b: torch.Tensor | None,
    eps: float,
    cast_order: str,
    offset: float = 0.0,
) -> torch.Tensor:
    """Triton ``reference.layer_norm_math`` (two-pass mean / biased variance, rows held in registers)."""
    return norm(x, None, w, b, eps, cast_order, False, offset)[0]


def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    w: torch.Tensor | None,
    eps: float,
    cast_order: str,
    offset: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton residual add + RMSNorm: ``(rms_norm(x + residual), x + residual)``, one pass."""
    y, h = norm(x, residual, w, None, eps, cast_order, True, offset)
    return y, h
