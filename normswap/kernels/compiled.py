"""Compiled backend: ``torch.compile`` (inductor) of the reference math.

Inductor turns each norm into one fused loop per row (a C++/OpenMP kernel on CPU, Triton on CUDA) that
reads the input once from memory and writes the output once, instead of the five or six full passes of
the eager op sequence. The cast order survives compilation because we compile with inductor's
``emulate_precision_casts`` (see ``compiled_function``), so results differ from eager only by the float32
summation order of the reduction.

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


def _rms(x: torch.Tensor, w: torch.Tensor | None, eps: float, cast_order: str) -> torch.Tensor:
    return ref.rms_norm_math(x, w, eps, cast_order)


def _layer(
    x: torch.Tensor, w: torch.Tensor | None, b: torch.Tensor | None, eps: float, cast_order: str
) -> torch.Tensor:
    return ref.layer_norm_math(x, w, b, eps, cast_order)


def _add_rms(
    x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor | None, eps: float, cast_order: str
) -> tuple[torch.Tensor, torch.Tensor]:
    h = x + residual
    return ref.rms_norm_math(h, w, eps, cast_order), h


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
