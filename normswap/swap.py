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


def _is_identity(tensor: torch.Tensor | None, offset: float) -> bool:
    return tensor is not None and bool((tensor.detach() == 1.0 - offset).all())


def fused_module(
    site: NormSite, original: nn.Module | None = None, identity_weights: bool = True
) -> nn.Module:
    """Build the fused module for ``site``, taking parameters from ``original`` when given.

    The fused module holds ``original``'s very Parameter objects (so a Parameter shared with another module
    stays shared, and an optimizer that holds it keeps training it); one that is an inference tensor is
    copied instead (it could not be trained). A folded RMSNorm whose weight is the identity is built with
    ``identity_weight=True`` (no weight tensor, the weight-free norm; see ``normswap.kernels.modules``)
    unless ``identity_weights`` is False.

    Raises:
        ValueError: ``site.kind`` is neither ``"rmsnorm"`` nor ``"layernorm"``.
    """
    tensors = [getattr(original, n) for n in (site.weight, site.bias) if n and original is not None]
    device = tensors[0].device if tensors else None
    dtype = tensors[0].dtype if tensors else (getattr(torch, site.dtype) if site.dtype != "none" else None)
    common = dict(eps=site.eps, offset=site.offset, cast_order=site.cast_order, weight_name=site.weight,
                  device=device, dtype=dtype, compute_dtype=site.compute_dtype)  # fmt: skip
    identity = (
        identity_weights
        and site.folded
        and site.kind == "rmsnorm"
        and not site.bias
        and site.weight is not None
        and (original is None or _is_identity(tensors[0], site.offset))
    )
    if site.kind == "rmsnorm" and site.bias:
        # a LayerNorm that centering turned into an RMSNorm but whose bias could not be folded
        from normswap.kernels.biased import BiasedRMSNorm

        fused = BiasedRMSNorm(site.shape, bias_name=site.bias, **common)
    elif site.kind == "rmsnorm":
        fused = FusedRMSNorm(site.shape, identity_weight=identity, **common)
    elif site.kind == "layernorm":
        fused = FusedLayerNorm(site.shape, bias_name=site.bias, **common)
    else:
        raise ValueError(f"{site.name}: unknown norm kind {site.kind!r}")
    if original is not None:
        for name in (site.weight, site.bias):
            if name and not (identity and name == site.weight):
                src = getattr(original, name)
                if not isinstance(src, nn.Parameter) or src.is_inference():
                    with torch.inference_mode(False), torch.no_grad():
                        src = nn.Parameter(src.detach().clone(), requires_grad=src.requires_grad)
                setattr(fused, name, src)
    fused.train(original.training if original is not None else False)
    return fused


def swap_norms(model: nn.Module, sites: list[NormSite], identity_weights: bool = True) -> int:
    """Install a fused module at every swappable site, in place; returns how many were swapped.

    A module that already is one of normswap's fused modules is kept as it is (and counted).

    Args:
        model: the model whose modules are named by ``site.name``.
        sites: norm sites from ``walk`` (or from a saved ``normswap.json``).
        identity_weights: build folded RMSNorms whose weight is the identity without a weight tensor
            (``fused_module``); False keeps every weight as a trainable Parameter.

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
        if isinstance(original, FusedRMSNorm | FusedLayerNorm):
            site.act("swap", swapped=True)
            count += 1
            continue
        fused = fused_module(site, original, identity_weights)
        carry_hook(original, fused)  # device_map placement (accelerate's AlignDevicesHook)
        setattr(parent, attr, fused)
        site.act("swap", swapped=True)
        count += 1
    return count
