"""Triton backend (CUDA): one kernel for RMSNorm, LayerNorm and residual-add + RMSNorm.

Imported lazily by ``ops.py`` only for CUDA tensors when triton is installed. Each program loads whole
rows into registers (``ROWS`` rows of ``BLOCK_D >= D`` columns), reduces in float32, and writes the
output once, so memory traffic is one read of ``x`` (and ``residual``) and one write of ``y`` (and
``x + residual``): the bound of a same-size copy. Rows of ``D`` above ``MAX_D`` go to the torch backend.

Numerics follow ``reference.py`` step by step, including every rounding torch performs:
``x + residual`` is rounded to its promoted dtype before normalizing; in ``"llama"`` order the normalized
value is rounded to the input dtype before the weight multiply, and the weight product is rounded to the
output dtype before a bias is added. A product of two half/bfloat16 values is exact in float32, so one
rounding at the store reproduces torch's elementwise multiply. What differs from torch is only the
float32 summation order of the row reduction (and rsqrt's last bit), i.e. at most 1 ulp of the output
on rare elements.

The kernel can be checked without a GPU in triton's interpreter (``TRITON_INTERPRET=1`` set before this
module is imported; CPU tensors), which ``tests/test_kernels.py`` does when triton is installed.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from normswap.kernels.reference import output_dtype

MAX_D = 65536


@triton.jit
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
    IS_RMS: tl.constexpr,
    LLAMA: tl.constexpr,
    HAS_W: tl.constexpr,
    HAS_B: tl.constexpr,
    HAS_RES: tl.constexpr,
    PER_HEAD: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_D)
    col_ok = cols < D
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
            y = y * tl.load(W + w_offs, mask=mask, other=0.0).to(tl.float32)
        else:  # (D,) weight: loaded once per program, broadcast over its rows
            y = y * tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if HAS_B:
        if LLAMA and HAS_W:
            y = y.to(Y.dtype.element_ty).to(tl.float32)
        if PER_HEAD:
            b_offs = (rows % B_ROWS).to(tl.int64)[:, None] * D + cols[None, :]
            y = y + tl.load(B + b_offs, mask=mask, other=0.0).to(tl.float32)
        else:
            y = y + tl.load(B + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)


# Rows of at least this many (padded) columns get one program each; shorter rows (q/k norms' head dims,
# small models) are packed several to a program so that each program still moves a useful tile.
_ONE_ROW_BLOCK = 1024
_TILE = 2048  # elements per program when packing short rows


def _config(d: int) -> tuple[int, int, int]:
    """(BLOCK_D, ROWS per program, num_warps) for rows of ``d`` elements.

    ``BLOCK_D`` is the power of two covering the row (masked beyond ``d``), so each thread holds whole
    16-byte vectors. One row per program from ``_ONE_ROW_BLOCK`` columns on, with warps growing with the
    row (8 from 2048 columns, 16 from 8192, 32 from 32768: 8-16 elements per thread, the thresholds of
    Liger-Kernel's ``calculate_settings``); shorter rows are packed ``_TILE // BLOCK_D`` to a program
    (at most 64) with 4 warps.
    """
    block = triton.next_power_of_2(d)
    if block >= _ONE_ROW_BLOCK:
        warps = 32 if block >= 32768 else 16 if block >= 8192 else 8 if block >= 2048 else 4
        return block, 1, warps
    return block, max(1, min(64, _TILE // block)), 4


# Launch metadata per (row length, dtypes, parameter shapes, flags): output dtypes, rows per program and
# the kernel's constant arguments, so a repeated call (every decode step) computes only the grid and
# launches. Bounded by the distinct norm configurations of the models in a process.
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
) -> tuple:
    key = (d, x_dtype, r_dtype, w_shape, w_dtype, b_shape, b_dtype, cast_order, is_rms)
    plan = _LAUNCH_CACHE.get(key)
    if plan is None:
        hdt = x_dtype if r_dtype is None else torch.promote_types(x_dtype, r_dtype)
        ydt = output_dtype(hdt, w_dtype, b_dtype, cast_order)
        block, rows, warps = _config(d)
        w_rows = 1 if w_shape is None else math.prod(w_shape) // d
        b_rows = 1 if b_shape is None else math.prod(b_shape) // d
        meta = {
            "IS_RMS": is_rms,
            "LLAMA": cast_order == "llama",
            "HAS_W": w_shape is not None,
            "HAS_B": b_shape is not None,
            "HAS_RES": r_dtype is not None,
            "PER_HEAD": w_rows > 1 or b_rows > 1,
            "ROWS": rows,
            "BLOCK_D": block,
            "num_warps": warps,
            # No FMA contraction: in "llama" order ``w * n`` is rounded to the output dtype before ``+ b``, as
            # torch does in two kernels; with contraction on (triton's default) the multiply and the add
            # became one fma with one rounding. Measured on an H200 (triton 3.6), llama-order LayerNorm
            # against the eager reference: 30% of the elements differed (up to 254 ulps where w * n cancels
            # b), under 0.01% without. Kernel time unchanged within the run-to-run spread.
            "enable_fp_fusion": False,
        }
        plan = _LAUNCH_CACHE[key] = (hdt, ydt, rows, w_rows, b_rows, meta)
    return plan


def _launch(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    w: torch.Tensor | None,
    b: torch.Tensor | None,
    eps: float,
    cast_order: str,
    is_rms: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    d = x.shape[-1]
    if d > MAX_D:
        raise ValueError(f"triton norm supports rows of at most {MAX_D} elements, got {d}")
    x = x.contiguous()
    n_rows = x.numel() // d if d else 0
    hdt, ydt, rows, w_rows, b_rows, meta = _plan(
        d,
        x.dtype,
        None if residual is None else residual.dtype,
        None if w is None else tuple(w.shape),
        None if w is None else w.dtype,
        None if b is None else tuple(b.shape),
        None if b is None else b.dtype,
        cast_order,
        is_rms,
    )
    y = torch.empty(x.shape, dtype=ydt, device=x.device)
    h = None if residual is None else torch.empty(x.shape, dtype=hdt, device=x.device)
    if n_rows == 0:
        return y, h
    w_c = None if w is None else w.contiguous()
    b_c = None if b is None else b.contiguous()
    _norm_kernel[(triton.cdiv(n_rows, rows),)](
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
        **meta,
    )
    return y, h


def rms_norm(x: torch.Tensor, w: torch.Tensor | None, eps: float, cast_order: str) -> torch.Tensor:
    """Triton ``reference.rms_norm_math``: ``x`` (..., D) on CUDA, effective weight ``w`` or None."""
    return _launch(x, None, w, None, eps, cast_order, True)[0]


def layer_norm(
    x: torch.Tensor, w: torch.Tensor | None, b: torch.Tensor | None, eps: float, cast_order: str
) -> torch.Tensor:
    """Triton ``reference.layer_norm_math`` (two-pass mean / biased variance, rows held in registers)."""
    return _launch(x, None, w, b, eps, cast_order, False)[0]


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor | None, eps: float, cast_order: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton residual add + RMSNorm: ``(rms_norm(x + residual), x + residual)``, one pass."""
    y, h = _launch(x, residual, w, None, eps, cast_order, True)
    return y, h
