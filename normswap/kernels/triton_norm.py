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
    ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_D)
    mask = (rows < n_rows)[:, None] & (cols < D)[None, :]
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
        w_offs = (rows % W_ROWS).to(tl.int64)[:, None] * D + cols[None, :]
        y = y * tl.load(W + w_offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_B:
        if LLAMA and HAS_W:
            y = y.to(Y.dtype.element_ty).to(tl.float32)
        b_offs = (rows % B_ROWS).to(tl.int64)[:, None] * D + cols[None, :]
        y = y + tl.load(B + b_offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)


def _config(d: int) -> tuple[int, int, int]:
    """(BLOCK_D, ROWS per program, num_warps) for rows of ``d`` elements."""
    block = triton.next_power_of_2(d)
    rows = max(1, min(16, 4096 // block))
    warps = 4 if block * rows <= 4096 else 8 if block <= 8192 else 16
    return block, rows, warps


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
    hdt = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    wdt = None if w is None else w.dtype
    bdt = None if b is None else b.dtype
    y = torch.empty(x.shape, dtype=output_dtype(hdt, wdt, bdt, cast_order), device=x.device)
    h = None if residual is None else torch.empty(x.shape, dtype=hdt, device=x.device)
    n_rows = x.numel() // d if d else 0
    if n_rows == 0:
        return y, h
    w_c = None if w is None else w.contiguous()
    b_c = None if b is None else b.contiguous()
    block, rows, warps = _config(d)
    grid = (triton.cdiv(n_rows, rows),)
    _norm_kernel[grid](
        x,
        x if residual is None else residual.contiguous(),
        x if w_c is None else w_c,
        x if b_c is None else b_c,
        y,
        y if h is None else h,
        n_rows,
        d,
        1 if w_c is None else w_c.numel() // d,
        1 if b_c is None else b_c.numel() // d,
        eps,
        IS_RMS=is_rms,
        LLAMA=cast_order == "llama",
        HAS_W=w_c is not None,
        HAS_B=b_c is not None,
        HAS_RES=residual is not None,
        ROWS=rows,
        BLOCK_D=block,
        num_warps=warps,
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
