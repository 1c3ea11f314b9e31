"""Compiled backend: ``torch.compile`` (inductor) of the reference math.

Inductor turns each norm into one fused loop per row (a C++/OpenMP kernel on CPU, Triton on CUDA) that
reads the input once from memory and writes the output once, instead of the five or six full passes of
the eager op sequence. The cast order survives compilation: the "llama" order rounds to the input dtype
with integer ops on the float32 bits (``_round_bits``), which inductor cannot fuse away (with torch 2.11 it
dropped the ``n.to(bf16)`` round trip despite ``emulate_precision_casts``, also set in
``compiled_function``), so results differ from eager only by the float32 summation order of the reduction
(bit-identical in bfloat16 on the test shapes).

The first call for each (function, dtypes, trailing shape, eps) compiles, which costs seconds (about 15 s
for the first kernel of a fresh process on a 2-core CPU, less once inductor's on-disk cache is warm; see
docs/KERNELS.md). That is why this backend is opt-in (``backend="compiled"`` or
``NORMSWAP_BACKEND=compiled``) and never the default. The number of leading rows is compiled as a dynamic
size, so prefill and decode lengths share one kernel (a single row is specialized once more).
"""

from __future__ import annotations

import torch

from normswap.kernels import reference as ref

# Distinct (dtypes, hidden size, eps, cast order) combinations a process may meet; dynamo's default of 8
# recompiles per function would silently fall back to eager after that.
_RECOMPILE_LIMIT = 64
# Below this many elements a call is dominated by the compiled function's fixed cost (guards, wrappers:
# ~70 us here against ~50 us for the whole eager norm of one 576-wide row), so the eager reference runs
# instead; it computes the same values (to the float32 summation order). Decode steps stay this small.
MIN_ELEMENTS = 8192


# Mantissa bits float32 has beyond each low precision: rounding drops them (round to nearest, ties to even).
_DROPPED_BITS = {torch.bfloat16: 16, torch.float16: 13}


def _round_bits(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32 ``t`` rounded to ``dtype``'s precision, still in float32, with integer ops on its bits.

    ``t.to(dtype).to(torch.float32)`` is a pair of casts inductor may fuse away (Triton and C++ kernels
    compute in float32 and keep the unrounded value); integer arithmetic it cannot. Exact for bfloat16 and
    for float16's normal range (a float16 subnormal keeps a few more bits here and is rounded again by the
    cast that follows: within its ulp).
    """
    k = _DROPPED_BITS[dtype]
    bits = t.view(torch.int32)
    bits = (bits + ((1 << (k - 1)) - 1) + ((bits >> k) & 1)) & -(1 << k)
    return bits.view(torch.float32)


def _exact(t: torch.Tensor) -> torch.Tensor:
    """``t`` (a bfloat16/float16 result inductor may hold unrounded in float32) with its rounding made
    explicit; other dtypes unchanged."""
    if t.dtype not in _DROPPED_BITS:
        return t
    return _round_bits(t.float(), t.dtype).to(t.dtype)


def _llama_finish(
    n: torch.Tensor, x_dtype: torch.dtype, w: torch.Tensor | None, b: torch.Tensor | None
) -> torch.Tensor:
    """``reference._finish`` in "llama" order with every low-precision rounding explicit: the normalized
    ``n`` rounded to the input dtype, then ``w * y`` and ``+ b`` each rounded to their result dtype, as eager
    torch rounds them (``emulate_precision_casts`` asks inductor for the same; this does not depend on it)."""
    y = (
        _round_bits(n, x_dtype).to(x_dtype)
        if x_dtype in _DROPPED_BITS and n.dtype == torch.float32
        else n.to(x_dtype)
    )
    if w is not None:
        y = _exact(w * y)
    if b is not None:
        y = _exact(y + b)
    return y


def _rms(x: torch.Tensor, w: torch.Tensor | None, eps: float, cast_order: str) -> torch.Tensor:
    if cast_order != "llama":
        return ref.rms_norm_math(x, w, eps, cast_order)
    xf = x.to(ref.compute_dtype(x.dtype))
    n = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return _llama_finish(n, x.dtype, w, None)


def _layer(
    x: torch.Tensor, w: torch.Tensor | None, b: torch.Tensor | None, eps: float, cast_order: str
) -> torch.Tensor:
    if cast_order != "llama":
        return ref.layer_norm_math(x, w, b, eps, cast_order)
    xf = x.to(ref.compute_dtype(x.dtype))
    centered = xf - xf.mean(-1, keepdim=True)
    n = centered * torch.rsqrt(centered.pow(2).mean(-1, keepdim=True) + eps)
    return _llama_finish(n, x.dtype, w, b)


def _add_rms(
    x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor | None, eps: float, cast_order: str
) -> tuple[torch.Tensor, torch.Tensor]:
    h = _exact(x + residual)
    return _rms(h, w, eps, cast_order), h


_CACHE: dict = {}


def compiled_function(fn):
    """``torch.compile(fn)`` as this backend compiles (fullgraph, ``emulate_precision_casts``), cached per
    function. Used by the benchmark to compile its reference kernels exactly like the norms."""
    c = _CACHE.get(fn)
    if c is None:
        # emulate_precision_casts: without it inductor drops the low-precision round trip of
        # ``n.to(x.dtype)`` in "llama" order (it reuses the float32 value), which is the C2 fault.
        c = _CACHE[fn] = torch.compile(fn, fullgraph=True, options={"emulate_precision_casts": True})
    return c


def _rows(x: torch.Tensor, p: torch.Tensor | None) -> torch.Tensor:
    """View ``x`` as (rows, *param_shape) so the row count is the only leading (dynamic) dim."""
    k = 1 if p is None else p.dim()
    x2 = x.reshape(-1, *x.shape[x.dim() - k :])
    torch._dynamo.maybe_mark_dynamic(x2, 0)
    return x2


_SEEN: set = set()


def _key(fn, n_rows_args: int, args) -> tuple:
    """What dynamo guards on for our functions: dtypes and shapes (of the first ``n_rows_args`` tensors,
    the row views, only the trailing dims and whether there are 0, 1 or more rows), and constants."""
    parts: list = [fn, torch.is_grad_enabled(), torch.is_inference_mode_enabled()]
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            shape = (min(a.shape[0], 2), *a.shape[1:]) if i < n_rows_args else tuple(a.shape)
            parts.append((a.dtype, a.device, shape))
        else:
            parts.append(a)
    return tuple(parts)


def _run(fn, n_rows_args: int, *args):
    key = _key(fn, n_rows_args, args)
    if key in _SEEN:  # compiled already: skip the config patch (it costs ~40 us a call)
        return compiled_function(fn)(*args)
    with torch._dynamo.config.patch(recompile_limit=_RECOMPILE_LIMIT):
        out = compiled_function(fn)(*args)
    _SEEN.add(key)
    return out


def rms_norm(x: torch.Tensor, w: torch.Tensor | None, eps: float, cast_order: str) -> torch.Tensor:
    """Compiled ``reference.rms_norm_math``; same arguments, shapes and dtypes."""
    if x.numel() < MIN_ELEMENTS:
        return ref.rms_norm_math(x, w, eps, cast_order)
    return _run(_rms, 1, _rows(x, w), w, eps, cast_order).reshape(x.shape)


def layer_norm(
    x: torch.Tensor, w: torch.Tensor | None, b: torch.Tensor | None, eps: float, cast_order: str
) -> torch.Tensor:
    """Compiled ``reference.layer_norm_math``; same arguments, shapes and dtypes."""
    if x.numel() < MIN_ELEMENTS:
        return ref.layer_norm_math(x, w, b, eps, cast_order)
    p = w if w is not None else b
    return _run(_layer, 1, _rows(x, p), w, b, eps, cast_order).reshape(x.shape)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor | None, eps: float, cast_order: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Compiled residual add + RMSNorm: returns ``(rms_norm(x + residual), x + residual)``."""
    if x.numel() < MIN_ELEMENTS:
        h = x + residual
        return ref.rms_norm_math(h, w, eps, cast_order), h
    shape = torch.broadcast_shapes(x.shape, residual.shape)
    x2 = _rows(x.expand(shape), w)
    r2 = _rows(residual.expand(shape), w)
    y, h = _run(_add_rms, 2, x2, r2, w, eps, cast_order)
    return y.reshape(shape), h.reshape(shape)
