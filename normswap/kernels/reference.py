"""Eager reference math for the fused norms: the exact op sequence of the modules normswap replaces.

Every backend computes the same formulas; this file is their specification and the default CPU path.
``x`` has shape ``(..., D)``; normalization is over the last axis only; ``w``/``b`` broadcast over the
trailing dims of ``x`` (``(D,)`` or per-head ``(H, D)``).

    rmsnorm:   n = x * rsqrt(mean(x**2) + eps)                        (Zhang & Sennrich, 2019)
    layernorm: n = (x - mean(x)) * rsqrt(mean((x - mean(x))**2) + eps)   (Ba et al., 2016; biased variance)

Cast orders (``n`` is always computed in float32, or float64 for float64 inputs):

* ``"llama"``: ``y = w * n.to(x.dtype) [+ b]``, as transformers' ``LlamaRMSNorm``
  (``self.weight * hidden_states.to(input_dtype)``); the output dtype is the promotion of the parameter
  dtypes and ``x.dtype``.
* ``"fp32"``: ``y = (n * w.float() [+ b.float()]).to(x.dtype)``, as ``GemmaRMSNorm``
  (``output * (1.0 + self.weight.float())`` then ``.type_as(x)``), ``CohereLayerNorm`` and ``nn.LayerNorm``.

The functions here take *effective* parameters: the offset is already added (``prepare_params``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CAST_ORDERS = ("llama", "fp32")


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for half/bfloat16/float32 inputs, float64 for float64 (HF upcasts to float32 at least)."""
    return torch.promote_types(dtype, torch.float32)


def output_dtype(
    x_dtype: torch.dtype, w_dtype: torch.dtype | None, b_dtype: torch.dtype | None, cast_order: str
) -> torch.dtype:
    """Output dtype of a norm: ``x_dtype`` for ``"fp32"``; promotion with the parameters for ``"llama"``."""
    if cast_order == "fp32":
        return x_dtype
    out = x_dtype
    for d in (w_dtype, b_dtype):
        if d is not None:
            out = torch.promote_types(out, d)
    return out


def check_args(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    offset: float,
    cast_order: str,
) -> None:
    """Validate the arguments of a norm op.

    Raises:
        ValueError: unknown cast order, non-float input or parameter, a parameter whose shape is not a
            suffix of ``x.shape`` ending in ``D``, or a nonzero offset without a weight.
    """
    if (  # the common case, decided cheaply: decode-sized norms are dominated by call overhead
        bias is None
        and weight is not None
        and weight.dim() == 1
        and x.dim() > 0
        and x.shape[-1] == weight.shape[0]
        and x.is_floating_point()
        and weight.is_floating_point()
        and cast_order in CAST_ORDERS
    ):
        return
    if cast_order not in CAST_ORDERS:
        raise ValueError(f"cast_order must be one of {CAST_ORDERS}, got {cast_order!r}")
    if not x.is_floating_point():
        raise ValueError(f"norm input must be a floating-point tensor, got {x.dtype}")
    if x.dim() == 0:
        raise ValueError("norm input must have at least one dimension")
    for name, p in (("weight", weight), ("bias", bias)):
        if p is None:
            continue
        if not p.is_floating_point():
            raise ValueError(f"norm {name} must be floating point, got {p.dtype}")
        if p.dim() == 0 or p.dim() > x.dim() or tuple(x.shape[-p.dim() :]) != tuple(p.shape):
            raise ValueError(
                f"norm {name} of shape {tuple(p.shape)} does not broadcast over the trailing dims of the "
                f"input of shape {tuple(x.shape)} (expected (D,) or (H, D) matching the input's last dims)"
            )
    if weight is None and offset != 0.0:
        raise ValueError(f"offset={offset} needs a weight; a parameter-free norm has offset 0")


def prepare_params(
    weight: torch.Tensor | None, bias: torch.Tensor | None, offset: float, cast_order: str
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Effective parameters ``(offset + w, b)`` in the dtype the cast order multiplies in.

    ``"llama"``: ``offset + w`` in the weight's dtype, bias unchanged. ``"fp32"``: ``offset + w.float()``
    and ``b.float()`` (float64 parameters stay float64). Shapes are unchanged.
    """
    if cast_order == "fp32":
        if weight is not None:
            weight = weight.to(compute_dtype(weight.dtype))
        if bias is not None:
            bias = bias.to(compute_dtype(bias.dtype))
    if weight is not None and offset != 0.0:
        weight = offset + weight
    return weight, bias


def _finish(
    n: torch.Tensor, x_dtype: torch.dtype, w: torch.Tensor | None, b: torch.Tensor | None, cast_order: str
) -> torch.Tensor:
    """Apply the affine part to the float32 normalized ``n`` in the given cast order."""
    if cast_order == "llama":
        y = n.to(x_dtype)
        if w is not None:
            y = w * y
        if b is not None:
            y = y + b
        return y
    if w is not None:
        n = n * w
    if b is not None:
        n = n + b
    return n.to(x_dtype)


def rms_norm_math(x: torch.Tensor, w: torch.Tensor | None, eps: float, cast_order: str) -> torch.Tensor:
    """RMSNorm of ``x`` (shape ``(..., D)``) with effective weight ``w``; HF's op sequence exactly."""
    xf = x.to(compute_dtype(x.dtype))
    variance = xf.pow(2).mean(-1, keepdim=True)
    n = xf * torch.rsqrt(variance + eps)
    return _finish(n, x.dtype, w, None, cast_order)


def layer_norm_math(
    x: torch.Tensor, w: torch.Tensor | None, b: torch.Tensor | None, eps: float, cast_order: str
) -> torch.Tensor:
    """LayerNorm with the two-pass formula of ``CohereLayerNorm`` (mean, then biased variance)."""
    xf = x.to(compute_dtype(x.dtype))
    centered = xf - xf.mean(-1, keepdim=True)
    variance = centered.pow(2).mean(-1, keepdim=True)
    n = centered * torch.rsqrt(variance + eps)
    return _finish(n, x.dtype, w, b, cast_order)


def layer_norm_torch(
    x: torch.Tensor, w: torch.Tensor | None, b: torch.Tensor | None, eps: float, cast_order: str
) -> torch.Tensor:
    """LayerNorm through ``F.layer_norm`` (fused on CPU and CUDA); bit-exact to ``nn.LayerNorm``.

    In ``"fp32"`` order with ``(D,)`` parameters, half/bfloat16 inputs go in as they are on the CPU: torch's
    CPU kernel accepts float32 parameters with a low-precision input, computes in float32 and rounds once,
    which is what ``nn.LayerNorm`` does; elsewhere (CUDA) the input is upcast to float32 first and the
    result rounded once. Other cases normalize with ``F.layer_norm`` and apply the affine part
    separately.
    """
    d = x.shape[-1]
    cdt = compute_dtype(x.dtype)
    one_d = all(p is None or p.dim() == 1 for p in (w, b))
    if cast_order == "fp32" and one_d:
        same = all(p is None or p.dtype == cdt for p in (w, b))
        # Parameter-free float16 goes the upcast way below: that is OLMo's formula, and torch's native
        # float16 kernel differs from it by 1 ulp on some elements.
        low = x.dtype == torch.bfloat16 or (x.dtype == torch.float16 and w is not None)
        # Only the CPU kernel takes float32 parameters with a half input; CUDA's wants one dtype ("expected
        # scalar type BFloat16 but found Float") and goes the upcast way below (float32 math, one rounding).
        if low and same and x.device.type == "cpu":
            return F.layer_norm(x, (d,), w, b, eps)
        if x.dtype == cdt and same:
            return F.layer_norm(x, (d,), w, b, eps)
        return F.layer_norm(x.to(cdt), (d,), w, b, eps).to(x.dtype)
    n = F.layer_norm(x.to(cdt), (d,), None, None, eps)
    return _finish(n, x.dtype, w, b, cast_order)


def rms_norm_torch(x: torch.Tensor, w: torch.Tensor | None, eps: float, cast_order: str) -> torch.Tensor:
    """RMSNorm through ``F.rms_norm`` (a fused kernel on CUDA, composite on CPU)."""
    d = x.shape[-1]
    if cast_order == "llama" or w is None:
        # F.rms_norm of a low-precision input normalizes in float32 and rounds once: n.to(x.dtype), which
        # is also the whole "fp32" order without a weight.
        y = F.rms_norm(x, (d,), None, eps)
        return y if w is None else w * y
    cdt = compute_dtype(x.dtype)
    if w is not None and w.dim() == 1:
        return F.rms_norm(x.to(cdt), (d,), w, eps).to(x.dtype)
    return _finish(F.rms_norm(x.to(cdt), (d,), None, eps), x.dtype, w, None, cast_order)
