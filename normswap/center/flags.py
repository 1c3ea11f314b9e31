"""Config flags that add the consumer biases a norm's bias needs (docs/CENTERING.md, "Norm biases").

Folding a norm's bias ``b`` into a consumer ``W x + c`` needs the bias ``c`` (``c' = c + W b``). Where a
consumer has none, a boolean config attribute whose name contains ``bias`` may add exactly such biases
(Falcon ``bias``, StableLM ``use_qkv_bias``). A flag is accepted only if the model class, built on the
meta device with the flag set, gains nothing but parameters that existing modules already hold as
``None`` (``nn.Linear(bias=False)``), with module types unchanged; zero biases then change nothing, and a
saved checkpoint loads in plain transformers with them. Where no flag fits, the norm keeps its bias as a
``BiasedRMSNorm``.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn

from normswap.sites import NormSite


@dataclass
class Flag:
    name: str
    biases: dict[str, tuple[str, torch.Size]]  # module -> (attribute, shape) of the bias the flag adds


def bias_blocked(site: NormSite) -> bool:
    """The walk left ``site`` unfolded only because some consumer has no bias to absorb the norm's bias.

    The consumers show that a bias is missing; that nothing else blocks the fold (a non-linear use of the
    output, which the site records only as text) shows in the reason: the walk reports its first
    objection, and the missing bias is its last check.
    """
    return (
        site.bias is not None
        and not site.foldable
        and any(c.bias is None for c in site.consumers)
        and "no bias to absorb" in (site.reason or "")
    )


def bias_flags(model: nn.Module, layer: list[NormSite]) -> tuple[list[Flag], list[NormSite]]:
    """Config flags that add exactly the missing consumer biases of the sites ``layer``, and the sites
    they make foldable (every missing bias covered)."""
    blocked = [s for s in layer if bias_blocked(s)]
    config = getattr(model, "config", None)
    if not blocked or config is None or not hasattr(config, "to_dict"):
        return [], []
    missing = {s.name: {c.module for c in s.consumers if c.bias is None} for s in blocked}
    candidates = [k for k, v in config.to_dict().items() if v is False and "bias" in k.lower()]
    valid = [f for f in (_flag_effect(model, name) for name in candidates) if f is not None and f.biases]
    covered = set().union(*(f.biases for f in valid)) if valid else set()
    resolved = [s for s in blocked if missing[s.name] <= covered]
    needed = set().union(*(missing[s.name] for s in resolved)) if resolved else set()
    flags = [f for f in valid if set(f.biases) & needed]
    return flags, resolved


def _flag_effect(model: nn.Module, flag: str) -> Flag | None:
    """Build ``type(model)`` on the meta device with ``config.flag = True``: which biases appear?

    Returns None unless the flag only adds parameters named in modules that hold that name as ``None``
    (a module built to take a bias, e.g. ``nn.Linear(bias=False)``), module types unchanged.
    """
    config = copy.deepcopy(model.config)
    setattr(config, flag, True)
    try:
        with torch.device("meta"):
            other = type(model)(config)
    except Exception:  # noqa: BLE001 - a class that cannot be rebuilt this way offers no flag
        return None
    before = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    after = dict(other.named_parameters(remove_duplicate=False))
    if before - set(after):
        return None
    modules = dict(model.named_modules())
    added = {}
    for name in after:  # in the model's parameter order (a set's order changes from run to run)
        if name in before:
            continue
        mod_name, _, attr = name.rpartition(".")
        mod = modules.get(mod_name)
        if mod is None or type(mod) is not type(other.get_submodule(mod_name)):
            return None
        if attr not in mod._parameters or mod._parameters[attr] is not None:
            return None
        added[mod_name] = (attr, after[name].shape)
    return Flag(flag, added)
