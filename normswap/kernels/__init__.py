"""Fused norm ops and modules.

Functional ops (``torch.library`` custom ops ``normswap::rms_norm``, ``normswap::layer_norm``,
``normswap::add_rms_norm`` underneath): ``rms_norm``, ``layer_norm``, ``add_rms_norm``.
Modules: ``FusedRMSNorm``, ``FusedLayerNorm``. Backends and their choice: ``ops.py``; formulas and cast
orders: ``reference.py``; measurements: docs/KERNELS.md.
"""

from normswap.kernels.modules import FusedLayerNorm, FusedRMSNorm
from normswap.kernels.ops import BACKENDS, add_rms_norm, layer_norm, resolve_backend, rms_norm

__all__ = [
    "BACKENDS",
    "FusedLayerNorm",
    "FusedRMSNorm",
    "add_rms_norm",
    "layer_norm",
    "resolve_backend",
    "rms_norm",
]
