"""``BiasedRMSNorm``: the module a centered LayerNorm becomes when no consumer can take its bias.

On a zero-mean input a LayerNorm equals an RMSNorm with the same eps, weight and bias (docs/CENTERING.md),
so a norm whose bias cannot be folded keeps it here: ``y = RMSNorm(x) * (offset + w) + b``.
"""

from __future__ import annotations

import torch
from torch import nn

from normswap.kernels import FusedRMSNorm, rms_norm


class BiasedRMSNorm(FusedRMSNorm):
    """``FusedRMSNorm`` plus an additive bias: a centered LayerNorm that keeps its bias parameter.

    ``y = x * rsqrt(mean(x**2) + eps) * (offset + weight) + bias`` over the last axis. Cast order
    ``"fp32"`` (``nn.LayerNorm``'s): ``y = (n * (offset + w).float() + b.float()).to(x.dtype)``, one
    rounding; ``"llama"``: ``y = (offset + w) * n.to(x.dtype) + b``. Keeping the bias (zero once folded)
    keeps the original LayerNorm's state-dict keys, so a saved checkpoint is in the model's own format.

    Args:
        shape, eps, offset, cast_order, weight_name, device, dtype, backend: as ``FusedRMSNorm``.
        bias_name: attribute name of the bias parameter (``shape``, initialized to 0).

    Forward: ``x`` of shape ``(..., D)`` -> same shape and dtype as ``FusedRMSNorm``'s.
    """

    def __init__(self, shape, eps: float, offset: float = 0.0, cast_order: str = "fp32",
                 weight_name: str | None = "weight", bias_name: str = "bias", device=None, dtype=None,
                 backend: str | None = None, compute_dtype: str | None = None) -> None:  # fmt: skip
        super().__init__(shape, eps, offset, cast_order, weight_name, device, dtype, backend, compute_dtype)
        self.bias_name = bias_name
        self.register_parameter(bias_name, nn.Parameter(torch.zeros(self.shape, device=device, dtype=dtype)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x, w, b, back = self._precision(x, *self._params())
        if self.cast_order == "llama":
            y = rms_norm(x, w, self.eps, self.offset, "llama", self.backend) + b
            return y if back is None else y.to(back)
        compute = torch.promote_types(x.dtype, torch.float32)
        y = rms_norm(
            x.to(compute), None if w is None else w.to(compute), self.eps, self.offset, "fp32", self.backend
        )
        return (y + b.to(compute)).to(back or x.dtype)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", bias_name={self.bias_name!r}"
