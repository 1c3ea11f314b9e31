"""Per-channel affine modules by numerical probing: BatchNorm in eval mode and affine-only norms.

A module is a per-channel affine map along axis ``a`` of its input when, for every input ``x``,

    y = x * scale[c] + shift[c]        (c: the index along axis ``a``; every other axis independent)

Probing decides it (``probe_affine``): the module's output on zeros is ``shift`` on every row, on ones
``scale + shift``, and on random inputs of two magnitudes exactly the map those give, so it is linear in
its input, diagonal, and independent of the other rows and positions (a BatchNorm that normalizes by batch
statistics, or any nonlinear module, fails). Then each of the module's own 1-D tensors is perturbed in
turn and classified by how ``scale`` and ``shift`` move:

    weight: scale moves in proportion to it            bias: shift moves by its change
    mean:   shift moves by -scale times its change      var:  scale moves as 1 / sqrt(var + eps)

and the kinds are

    batchnorm: scale = weight / sqrt(var + eps), shift = bias - mean * scale   (Ioffe & Szegedy, 2015;
               eval mode, running statistics)
    affine:    scale = weight,                   shift = bias                  (MobileBERT's NoNorm)

with eps measured (``(weight / scale)**2 - var``) and checked against the whole formula. Nothing here reads
class names or attribute names; the roles come from behaviour, as in ``probe.py`` for RMSNorm/LayerNorm.
Probing runs on a float64 CPU copy in eval mode; the model is never touched.
"""

from __future__ import annotations

import torch
from torch import nn

from normswap.device import cpu_float64_copy
from normswap.sites import Consumer, NormSite

_MAX_TENSORS = 4  # weight, bias, mean, var
_RTOL = 1e-5  # a module that computes in float32 internally agrees with the float64 formula to ~1e-7


def _close(a: torch.Tensor, b: torch.Tensor, rtol: float = _RTOL) -> bool:
    scale = max(a.abs().max().item(), b.abs().max().item(), 1e-30)
    return bool((a - b).abs().max().item() <= rtol * scale)


def _tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]


def channels(module: nn.Module) -> int | None:
    """``C`` when ``module`` could be a per-channel affine map: a leaf whose floating tensors (1 to 4) are all
    of shape ``(C,)`` and whose other tensors are 0-dim (a BatchNorm's ``num_batches_tracked``); else None."""
    if any(True for child in module.children() for _ in child.parameters()):
        return None
    tensors = [t for _, t in _tensors(module)]
    floats = [t for t in tensors if t.is_floating_point()]
    if not 1 <= len(floats) <= _MAX_TENSORS or any(t.ndim != 1 for t in floats):
        return None
    if any(not t.is_floating_point() and t.ndim > 0 for t in tensors):
        return None
    sizes = {t.shape[0] for t in floats}
    return sizes.pop() if len(sizes) == 1 else None


def channel_axes(module: nn.Module, input_shape: tuple[int, ...]) -> list[int]:
    """The axes of an input of ``input_shape`` along which ``module`` could act per channel: those as long
    as its tensors (``channels``). Cheap and static; ``probe_affine`` decides."""
    count = channels(module)
    return [] if count is None else [i for i, d in enumerate(input_shape) if d == count]


def _probe_shape(input_shape: tuple[int, ...], axis: int, count: int) -> tuple[int, ...]:
    """``input_shape`` with the channel axis kept and every other axis 3 long (5 when C is 3), so that no
    other axis has the channel count and the probe sees which axis the module acts on."""
    other = 5 if count == 3 else 3
    return tuple(count if i == axis else other for i in range(len(input_shape)))


def _run(module: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    try:
        with torch.no_grad():
            y = module(x)
    except Exception:  # noqa: BLE001 - a module that cannot take the input is not a map of it
        return None
    if not isinstance(y, torch.Tensor) or y.shape != x.shape or not y.is_floating_point():
        return None
    return y.double() if bool(torch.isfinite(y).all()) else None


def _per_channel(y: torch.Tensor, axis: int) -> torch.Tensor | None:
    """The per-channel vector ``y`` holds along ``axis`` when it is constant along every other axis."""
    rows = y.movedim(axis, 0).reshape(y.shape[axis], -1)
    first = rows[:, :1]
    return first[:, 0] if _close(rows, first.expand_as(rows), rtol=1e-9) else None


def _map(module: nn.Module, shape: tuple[int, ...], axis: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(scale, shift)`` read from the outputs on zeros and ones, or None when they are not per channel."""
    zeros = torch.zeros(shape, dtype=torch.float64, device="cpu")
    y0, y1 = _run(module, zeros), _run(module, zeros + 1.0)
    if y0 is None or y1 is None:
        return None
    shift, total = _per_channel(y0, axis), _per_channel(y1, axis)
    return None if shift is None or total is None else (total - shift, shift)


def _fit(module: nn.Module, shape: tuple[int, ...], axis: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(scale, shift)`` when ``module`` is a per-channel affine map along ``axis`` on inputs of ``shape``:
    checked on random inputs of magnitude ~3 and ~1000 with a different offset per channel."""
    found = _map(module, shape, axis)
    if found is None:
        return None
    scale, shift = found
    view = [1] * len(shape)
    view[axis] = -1
    gen = torch.Generator(device="cpu").manual_seed(0)
    for size in (3.0, 1000.0):
        x = torch.randn(shape, generator=gen, dtype=torch.float64, device="cpu") * size
        x = x + torch.randn(shape[axis], generator=gen, dtype=torch.float64, device="cpu").view(view) * size
        y = _run(module, x)
        if y is None or not _close(y, x * scale.view(view) + shift.view(view)):
            return None
    return scale, shift


def _roles(module: nn.Module, shape, axis, scale, shift) -> dict[str, str] | None:
    """Which of ``module``'s floating tensors (a float64 copy) is its weight, bias, mean and var, from how
    ``scale`` and ``shift`` move when each is perturbed; None when one fits no role or two share one."""
    roles: dict[str, str] = {}
    gen = torch.Generator(device="cpu").manual_seed(1)
    for name, t in _tensors(module):
        if not t.is_floating_point():
            continue
        delta = torch.rand(t.shape, generator=gen, dtype=t.dtype, device="cpu") * 0.5 + 0.25  # > 0: var stays
        saved = t.detach().clone()
        with torch.no_grad():
            t.add_(delta)
        moved = _map(module, shape, axis)
        with torch.no_grad():
            t.copy_(saved)
        if moved is None:
            return None
        scale2, shift2 = moved
        if _close(scale2, scale, rtol=1e-9):
            if _close(shift2 - shift, delta, rtol=1e-6):
                role = "bias"
            elif _close(shift2 - shift, -scale * delta, rtol=1e-6):
                role = "mean"
            else:
                return None
        elif _close(scale2 * saved, scale * (saved + delta), rtol=1e-6):
            role = "weight"
        elif bool((scale2.abs() <= scale.abs()).all()):
            role = "var"  # confirmed, with the eps it implies, by the whole formula in ``probe_affine``
        else:
            return None
        if role in roles:
            return None
        roles[role] = name
    return roles


def _snap_eps(estimate: float, module: nn.Module) -> float:
    """A float attribute of the module within 2% of the measured eps (BatchNorm's ``eps``), else the estimate
    to 6 digits (exact to ~1e-11 for a module that computes in float64: a hard-coded 1e-3 reads as 1e-3)."""
    for value in vars(module).values():
        if isinstance(value, float) and value > 0 and abs(value - estimate) <= 0.02 * estimate:
            return value
    return float(f"{estimate:.5e}") if estimate > 0 else 0.0


def _span(t: torch.Tensor) -> list[float]:
    return [t.min().item(), t.max().item()]


def probe_affine(
    module: nn.Module, input_shape: tuple[int, ...], name: str = "", axes: list[int] | None = None
) -> NormSite | None:
    """Decide by probing whether ``module`` is a per-channel affine map, and measure it.

    Args:
        module: the candidate (never modified; probing runs on a float64 CPU copy in eval mode, so a module
            in training mode is measured as it computes in eval mode; ``walk`` refuses to fold it).
        input_shape: shape of the tensor it was called with in the model.
        name: module name, recorded on the site.
        axes: the axes to try as the channel axis (default ``channel_axes(module, input_shape)``).

    Returns:
        A ``NormSite`` of kind ``"batchnorm"`` or ``"affine"`` (``axis``, ``eps``, the roles ``weight``,
        ``bias``, ``mean``, ``var``, ``stats``; ``swappable`` False: it is folded or left as it is), or
        None: not a per-channel affine map whose scale and shift its tensors set as in the module doc.
    """
    count = channels(module)
    axes = channel_axes(module, input_shape) if axes is None else axes
    if count is None or not axes:
        return None
    try:
        probe = cpu_float64_copy(module).eval()
    except ValueError:  # an offloaded tensor without a value: the walk refuses such models first
        return None
    # first inputs whose other axes differ in length from the channel axis, then the traced shape (for a
    # module that needs it); a module with equal parameters everywhere fits along any axis of length C, and
    # only its roles (each tensor perturbed at random per channel) tell which axis it acts on
    tries = [(_probe_shape(input_shape, axis, count), axis) for axis in axes]
    tries += [(tuple(input_shape), axis) for axis in axes]
    for shape, axis in dict.fromkeys(tries):
        fit = _fit(probe, shape, axis)
        site = None if fit is None else _site(module, probe, shape, axis, fit, input_shape, name)
        if site is not None:
            return site
    return None


def _site(module, probe, shape, axis, fit, input_shape, name) -> NormSite | None:
    scale, shift = fit
    roles = _roles(probe, shape, axis, scale, shift)
    if roles is None:
        return None
    values = {role: getattr(probe, attr).detach() for role, attr in roles.items()}
    weight = values.get("weight", torch.ones_like(scale))
    eps = 0.0
    if "var" in values:
        usable = scale != 0
        if not bool(usable.any()):
            return None
        estimate = ((weight[usable] / scale[usable]) ** 2 - values["var"][usable]).median().item()
        eps = _snap_eps(estimate, module)
        expected_scale = weight / torch.sqrt(values["var"] + eps)
    else:
        expected_scale = weight
    expected_shift = values.get("bias", torch.zeros_like(shift)) - values.get("mean", 0.0) * expected_scale
    size = max(scale.abs().max().item(), shift.abs().max().item(), 1e-30)  # a shift may be 0 everywhere
    if not _close(expected_scale, scale) or (expected_shift - shift).abs().max().item() > _RTOL * size:
        return None
    kind = "batchnorm" if {"mean", "var"} & roles.keys() else "affine"
    reference = getattr(module, roles.get("weight") or next(iter(roles.values())))
    stats = {"input_shape": list(input_shape), "scale": _span(scale), "shift": _span(shift)}
    for role in ("mean", "var"):
        if role in values:
            stats[role] = _span(values[role])
    return NormSite(
        name=name,
        kind=kind,
        offset=0.0,
        eps=eps,
        weight=roles.get("weight"),
        bias=roles.get("bias"),
        shape=(scale.numel(),),
        cast_order="fp32",
        dtype=str(reference.dtype).removeprefix("torch."),
        swappable=False,
        axis=axis,
        mean=roles.get("mean"),
        var=roles.get("var"),
        stats=stats,
    )


# -- where a site may fold: the walk's decision from what its trace saw ------------------------------


def affine_foldability(
    site: NormSite, call, reasons: list[str], module: nn.Module
) -> tuple[bool, str | None, Consumer | None]:
    """Whether a per-channel site the walk found folds exactly: into its consumers (preferred: every use of
    its output a linear map or convolution along its channel axis, each with a bias when it shifts, none
    zero-padding its input then), or else into the producer of its input (a linear map or convolution
    whose output only it reads, with a bias when it shifts).

    Args:
        site: from ``probe_affine``, with ``consumers`` set from the trace.
        call: the walk's record of the module's calls: ``extra`` (other inputs, described), ``producers``
            (per call: the op that made its input when a linear map or convolution made it, else None) and
            ``makers`` (per call: the op that made its input, described).
        reasons: why uses of its output are not consumers, in trace order.
        module: the module itself (its ``training`` flag).

    Returns:
        ``(foldable, reason, producer)``: the reason names what blocks each way, e.g. ``"output feeds gelu
        in X; producer Y has no bias to absorb the shift"``; ``producer`` is the op it folds into when it
        folds into the producer of its input, else None.
    """
    if call.extra:
        return False, f"called with another input ({call.extra}): not a one-input map, left in place", None
    if site.kind == "batchnorm" and module.training:
        return False, (
            "in training mode: a BatchNorm normalizes by each batch's statistics there, not by a fixed map "
            "(call model.eval() before converting)"
        ), None  # fmt: skip
    shifts = site.bias is not None or site.mean is not None
    into_consumers = _consumers_reason(site, reasons, shifts)
    if into_consumers is None:
        return True, None, None
    into_producer = _producer_reason(site, call, shifts)
    if into_producer is None:
        return True, None, call.producers[0].producer
    return False, f"{into_consumers}; {into_producer}", None


def _consumers_reason(site: NormSite, reasons: list[str], shifts: bool) -> str | None:
    if reasons:
        return f"output {reasons[0]}"
    if not site.consumers:
        return "output is never used by a linear map"
    if shifts:
        missing = sorted({c.module for c in site.consumers if c.bias is None})
        if missing:
            return f"consumer {missing[0]} has no bias to absorb the shift"
        padded = sorted({c.module for c in site.consumers if c.zero_pad})
        if padded:
            return f"consumer {padded[0]} pads its input with zeros, which a shift of it would not reach"
    return None


def _producer_reason(site: NormSite, call, shifts: bool) -> str | None:
    produced = call.producers
    if not produced or any(p is None for p in produced):
        maker = next((m for p, m in zip(produced, call.makers, strict=True) if p is None), "")
        return f"its input comes from {maker}, not from a linear map or convolution"
    if len(produced) > 1:
        return f"it is called {len(produced)} times"
    producer, uses = produced[0].producer, produced[0].uses
    if produced[0].channel != site.axis:
        return f"producer {producer.module} makes its channels along another axis"
    others = [(op, where) for op, where in uses if where != site.name]
    if others:
        op, where = others[0]
        user = f"{op} in {where}" if where else "the model's output"
        return f"its input, the output of {producer.module}, is also used by {user}"
    if shifts and producer.bias is None:
        return f"producer {producer.module} has no bias to absorb the shift"
    return None
