"""Folding a per-channel affine site (BatchNorm in eval mode, NoNorm) into a neighbouring linear map.

A site of ``AFFINE_KINDS`` computes ``y = x * a + s`` per channel ``c`` (``normswap.affine``:
``a = weight / sqrt(var + eps)``, ``s = bias - mean * a``). Two exact folds, both in float64:

* into its consumers ``z = W y + d`` (a linear map contracting the channel axis, or a convolution whose
  input channels it is, grouped or depthwise included): ``W <- W diag(a)`` along the contracted axis and
  ``d <- d + W s``; for a convolution ``d[o] += sum_{i,k} W[o, i, k] s[ch(o, i)]`` with
  ``ch(o, i) = (o // (out / groups)) * (in / groups) + i``. The shift part holds only where every output
  position sees the shift on all its taps: a convolution that zero-pads its input (``padding`` > 0)
  would see 0, not ``s``, at the border, so the walk refuses it (reflect / replicate / circular padding
  copies ``x + s`` and is exact);
* into its producer ``x = W u + d`` when that op's output goes nowhere else: ``W <- diag(a) W`` along
  the weight's output axis and ``d <- a d + s``.

Afterwards the module is left at its identity: weight 1, bias 0, running mean 0 and running variance
``1 - eps`` rounded to the variance's dtype, with eps rounded as the kernel rounds it (float32 for a
float32 or half-precision module). In float32, ``fl(fl(1 - eps) + eps) == 1`` exactly for every eps in
(0, 1/2] (the first rounding errs by at most 2**-25, half the spacing below 1, so the sum rounds back to 1;
the same holds in float64), so ``1 / sqrt(var + eps) == 1`` and the module returns its input bit for bit.
Setting ``weight = sqrt(var + eps)`` instead would leave a product of two roundings that is 1 only by
chance. In bfloat16 and float16 the variance rounds to 1 and ``x / sqrt(1 + eps)`` rounds back to ``x``
(eps is far below half an ulp). The
identity is not assumed but tested, on a copy of the module on its own device and dtype, before anything is
written: where it does not hold (a bfloat16 running variance cannot store ``1 - 1e-5``), the site is
refused with that reason. The module is kept (not removed), so the checkpoint has every tensor its config
expects and loads in plain transformers.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn

from normswap.fold import bias_delta, distinct_consumers, input_peaks, scale_axis_
from normswap.sites import AFFINE_KINDS, Consumer, NormSite
from normswap.walk import Walk


@torch.no_grad()
def scale_and_shift(site: NormSite, module: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The site's float64 per-channel map ``(a, s)`` from its module's tensors (``s`` None when the module
    has neither a bias nor a running mean), on the module's device."""
    roles = (("weight", site.weight), ("bias", site.bias), ("mean", site.mean), ("var", site.var))
    tensors = {role: getattr(module, attr).detach().double() for role, attr in roles if attr}
    like = next(iter(tensors.values()))
    scale = tensors.get("weight", torch.ones_like(like))
    if "var" in tensors:
        scale = scale / torch.sqrt(tensors["var"] + site.eps)
    if "bias" not in tensors and "mean" not in tensors:
        return scale, None
    shift = tensors.get("bias", torch.zeros_like(like)) - tensors.get("mean", torch.zeros_like(like)) * scale
    return scale, shift


def identity_values(site: NormSite, module: nn.Module) -> dict[str, torch.Tensor]:
    """Attribute -> the value that makes the module return its input: weight 1, bias 0, mean 0, var
    ``1 - eps`` (see the module doc), each in its own dtype and device."""
    values = {}
    for attr, value in ((site.weight, 1.0), (site.bias, 0.0), (site.mean, 0.0)):
        if attr:
            t = getattr(module, attr)
            values[attr] = torch.full_like(t, value)
    if site.var:
        t = getattr(module, site.var)
        compute = torch.float64 if t.dtype == torch.float64 else torch.float32  # the kernel's eps dtype
        one = torch.ones((), dtype=compute, device=t.device)
        values[site.var] = (
            (one - torch.tensor(site.eps, dtype=compute, device=t.device)).to(t.dtype).expand_as(t)
        )
    return values


@torch.no_grad()
def identity_error(site: NormSite, module: nn.Module) -> str | None:
    """Why the module at ``identity_values`` would not return its input bit for bit, or None when it does.

    Run on a copy of the module (its device, its dtype, eval mode) on a random input shaped like the
    traced one, cut to 3 along every axis but the channel axis.
    """
    trial = copy.deepcopy(module).eval()
    for attr, value in identity_values(site, trial).items():
        getattr(trial, attr).copy_(value)
    reference = getattr(module, site.weight or site.bias or site.mean or site.var)
    shape = [3] * len(site.stats["input_shape"])
    shape[site.axis] = site.shape[0]
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = (torch.randn(shape, generator=gen, device="cpu") * 3).to(reference.device, reference.dtype)
    y = trial(x)
    if torch.equal(y, x):
        return None
    dtype = str(reference.dtype).removeprefix("torch.")
    worst = (y.double() - x.double()).abs().max().item()
    what = f"running var 1 - eps with eps {site.eps:g}, " if site.var else ""
    return f"its identity ({what}weight 1, bias 0) is not exact in {dtype} (off by {worst:.3g}): not folded"


def _targets(site: NormSite) -> list[Consumer]:
    return [site.producer] if site.producer is not None else list(distinct_consumers(site))


def _channel_map(site: NormSite, c: Consumer, weight: torch.Tensor) -> torch.Tensor:
    """For a convolution consumer, the input channel each ``weight[o, i]`` reads: ``(out, in / groups)``."""
    out, per_group = weight.shape[0], weight.shape[1]
    group = torch.arange(out, device=weight.device) // (out // c.groups)
    return group[:, None] * per_group + torch.arange(per_group, device=weight.device)[None, :]


def _conv_factor(site, c, weight, vector: torch.Tensor) -> torch.Tensor:
    """``vector[ch(o, i)]`` shaped ``(out, in / groups, 1, ...)`` to broadcast over the kernel."""
    picked = vector.to(weight.device)[_channel_map(site, c, weight)]
    return picked.reshape(*picked.shape, *([1] * (weight.ndim - 2)))


def _is_conv(c: Consumer) -> bool:
    return c.op.startswith("conv")


@torch.no_grad()
def _folded(site, c: Consumer, weight, bias, scale, shift):
    """``(new weight or its input peaks, new bias or None)`` in float64 for target ``c``: what the fold
    writes (for a large linear weight only the per-index peaks, which decide overflow exactly)."""
    if site.producer is not None:
        peaks = input_peaks(weight, c.axis)
        new_weight = peaks.double() * scale.to(weight.device).abs() if peaks is not None else None
        new_bias = None
        if bias is not None:
            new_bias = bias.double() * scale.to(bias.device)
            if shift is not None:
                new_bias = new_bias + shift.to(bias.device)
        return new_weight, new_bias
    if _is_conv(c):
        new_weight = weight.double() * _conv_factor(site, c, weight, scale)
        delta = None
        if shift is not None:
            delta = (weight.double() * _conv_factor(site, c, weight, shift)).flatten(1).sum(1)
    else:
        peaks = input_peaks(weight, c.axis)
        new_weight = peaks.double() * scale.to(weight.device).abs() if peaks is not None else None
        delta = bias_delta(weight, shift, c.axis) if shift is not None else None
    new_bias = None if bias is None or delta is None else bias.double() + delta.to(bias.device)
    return new_weight, new_bias


def _overflow(site, scale, shift, read) -> str | None:
    """Why folding would store a value beyond a target's dtype range (float16: 65504), or None."""
    for c in _targets(site):
        weight = read(c.param)
        bias = read(c.bias) if c.bias else None
        new_weight, new_bias = _folded(site, c, weight, bias, scale, shift)
        for name, before, after in ((c.param, weight, new_weight), (c.bias, bias, new_bias)):
            if after is None:
                continue
            limit = torch.finfo(before.dtype).max
            if not bool(torch.isfinite(after).all()) or after.abs().max().item() > limit:
                dtype = str(before.dtype).removeprefix("torch.")
                return (
                    f"fold overflows {dtype} ({name} would need {after.abs().max().item():.3g} > {limit:.6g})"
                )
    return None


def _sharing(site: NormSite, walk: Walk, taken: set[tuple[str, bool]]) -> str | None:
    """Why a target weight or bias cannot take this fold alone: used by another op, or by another site."""
    for c in _targets(site):
        own = 1 if site.producer is not None else sum(x.param == c.param for x in site.consumers)
        for param in filter(None, (c.param, c.bias)):
            uses = walk.param_uses.get(param, [])
            if len(uses) > own:
                where = next((u for u in uses if u[1] != c.module), None)
                user = f"{where[0]} in {where[1]}" if where else f"another call of {c.module}"
                side = "producer" if site.producer else "consumer"
                return f"{side} {c.module}'s {param} is also used by {user}"
            side = (param, site.producer is not None)
            if side in taken:
                return f"{param} already takes the fold of another per-channel map on that side"
    return None


def plan_affine(
    model: nn.Module, walk: Walk, read: Callable[[str], torch.Tensor] | None = None
) -> list[NormSite]:
    """The foldable ``AFFINE_KINDS`` sites of ``walk`` that fold exactly; on the others a ``Decision``
    (step ``"affine fold plan"``) records them not foldable with the reason (a target weight shared, a
    fold that would overflow its dtype, an identity that is not exact in the module's dtype). Nothing is
    written.

    ``read(name)`` gives a parameter's values (default ``model.get_parameter``).
    """
    read = read or model.get_parameter
    planned, taken = [], set()
    for site in walk.sites:
        if site.kind not in AFFINE_KINDS or not site.foldable:
            continue
        module = model.get_submodule(site.name)
        scale, shift = scale_and_shift(site, module)
        reason = (
            _sharing(site, walk, taken) or _overflow(site, scale, shift, read)
            or identity_error(site, module)
        )  # fmt: skip
        if reason:
            site.decide("affine fold plan", foldable=False, reason=reason, producer=None)
            continue
        for c in _targets(site):
            taken.update((p, site.producer is not None) for p in (c.param, c.bias) if p)
        planned.append(site)
    return planned


@torch.no_grad()
def fold_affine(model: nn.Module, site: NormSite) -> None:
    """Fold one planned site into its producer or its consumers (float64, rounded once into each
    parameter's dtype), then set the module to ``identity_values``; in place."""
    module = model.get_submodule(site.name)
    scale, shift = scale_and_shift(site, module)
    for c in _targets(site):
        weight = model.get_parameter(c.param)
        bias = model.get_parameter(c.bias) if c.bias else None
        if site.producer is not None:
            if bias is not None:
                new_bias = bias.double() * scale.to(bias.device)
                bias.copy_(new_bias + shift.to(bias.device) if shift is not None else new_bias)
            scale_axis_(weight, scale, c.axis)
        elif _is_conv(c):
            if shift is not None and bias is not None:
                delta = (weight.double() * _conv_factor(site, c, weight, shift)).flatten(1).sum(1)
                bias.copy_(bias.double() + delta.to(bias.device))
            weight.copy_(weight.double() * _conv_factor(site, c, weight, scale))
        else:
            if shift is not None and bias is not None:
                bias.copy_(bias.double() + bias_delta(weight, shift, c.axis).to(bias.device))
            scale_axis_(weight, scale, c.axis)
    for attr, value in identity_values(site, module).items():
        getattr(module, attr).copy_(value)
    site.act("affine fold", folded=True)
