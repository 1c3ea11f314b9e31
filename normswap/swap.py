"""Replace each norm module by normswap's fused module of the same semantics, in place.

The fused module registers its parameters under the replaced module's attribute names, so module names and
state-dict keys do not change and a checkpoint saved afterwards is the model's own format.
"""

from __future__ import annotations

import torch
from torch import nn

from normswap.device import carry_hook
from normswap.kernels import FusedLayerNorm, FusedRMSNorm
from normswap.sites import NormSite


def fused_module(site: NormSite, original: nn.Module | None = None) -> nn.Module:
    """Build the fused module for ``site``, copying parameters from ``original`` when given.

    Raises:
        ValueError: ``site.kind`` is neither ``"rmsnorm"`` nor ``"layernorm"``.
    """
    tensors = [getattr(original, n) for n in (site.weight, site.bias) if n and original is not None]
    device = tensors[0].device if tensors else None
    dtype = tensors[0].dtype if tensors else (getattr(torch, site.dtype) if site.dtype != "none" else None)
    common = dict(eps=site.eps, offset=site.offset, cast_order=site.cast_order, weight_name=site.weight,
                  device=device, dtype=dtype, compute_dtype=site.compute_dtype)  # fmt: skip
    if site.kind == "rmsnorm" and site.bias:
        # a LayerNorm that centering turned into an RMSNorm but whose bias could not be folded
        from normswap.center import BiasedRMSNorm

        fused = BiasedRMSNorm(site.shape, bias_name=site.bias, **common)
    elif site.kind == "rmsnorm":
        fused = FusedRMSNorm(site.shape, **common)
    elif site.kind == "layernorm":
        fused = FusedLayerNorm(site.shape, bias_name=site.bias, **common)
    else:
        raise ValueError(f"{site.name}: unknown norm kind {site.kind!r}")
    if original is not None:
        with torch.no_grad():
            for name in (site.weight, site.bias):
                if name:
                    src = getattr(original, name)
                    getattr(fused, name).data = src.detach().clone()
    fused.train(original.training if original is not None else False)
    return fused


def swap_norms(model: nn.Module, sites: list[NormSite]) -> int:
    """Install a fused module at every swappable site, in place; returns how many were swapped.

    Args:
        model: the model whose modules are named by ``site.name``.
        sites: norm sites from ``walk`` (or from a saved ``normswap.json``).

    Raises:
        AttributeError: a site names a module the model does not have.
    """
    count = 0
    for site in sites:
        if not site.swappable:  # listed, but not a plain norm (``NormSite.swappable``): left in place
            continue
        parent_name, _, attr = site.name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        original = getattr(parent, attr)
        fused = fused_module(site, original)
        carry_hook(original, fused)  # device_map placement (accelerate's AlignDevicesHook)
        setattr(parent, attr, fused)
        site.swapped = True
        count += 1
    return count
