"""Norm semantics by numerical probing.

A module is a norm if, on inputs shaped like the ones it saw in the model, its output is

    rmsnorm:   y = x / sqrt(mean(x**2) + eps) * (offset + w)            (Zhang & Sennrich, 2019)
    layernorm: y = (x - mean(x)) / sqrt(var(x) + eps) * (offset + w) + b  (Ba et al., 2016)

over the last axis, with ``w`` and ``b`` among its own parameters, for any ``eps >= 0``. Nothing here reads
class names, attribute names or the config. No step assumes eps small (scale invariance holds only where the
mean square is far above eps):

* structure: a norm is odd about its bias (``y(x) + y(-x) = 2 b``, the same for every row) and scales each
  row of ``y - b`` by a factor ``lam`` in ``[1, 4)`` when its input is multiplied by 4 (1 for eps = 0,
  towards 4 as eps dominates); ``lam`` also gives a first eps, which sets the input scale of the steps below;
* kind: mean-shift invariance (exact for a LayerNorm whatever its eps);
* roles: perturbing the scale moves each row by ``s * delta * x`` (``s = 1 / sqrt(ms + eps)`` per row),
  the bias by ``delta``; offset from ``y - b = s * x * (offset + w)``;
* eps: measured on inputs whose mean square sweeps past eps (and then equals it);
* verification: the fitted norm (kind, eps, weight, offset, bias) must reproduce the module on fresh inputs
  within ``_FIT_RTOL``: far above eps (else the module is no norm), and at mean squares 1, eps and 10 eps.
  A module that is the fitted norm far above eps but that no eps reproduces near it raises ``ProbeError``
  (the walk lists it as a candidate it could not characterize, with the error).

All probing runs on float64 (and bfloat16) CPU copies of the module, so the model is never touched and the
result does not depend on the device the model lives on (a norm module is small: the copy costs a few KiB).
"""

from __future__ import annotations

import copy
import dataclasses
import math

import torch
from torch import nn

from normswap.device import cpu_float64_copy
from normswap.sites import NormSite

# Relative tolerance of the structural tests. Probing runs in float64 where the module lets it; modules that
# upcast to float32 internally (most HF norms) still agree with the float64 formula to ~1e-6 relative.
_RTOL = 1e-4
# Relative tolerance (to the largest output) of the final fit. The fitted norm is evaluated in float64
# (rounding ~1e-15); the module's float64 copy computes in float64, or in float32 where it upcasts (HF's
# norms): a few float32 roundings of 6e-8 each, measured at most 2.0e-7 over the 479 norms of the zoo's 70
# rows; the measured eps is good to ~1e-7 relative, which moves the output by half that. 1e-5 leaves a
# margin of 50 over float32 and fails any other map by orders of magnitude (another kind, an eps off by
# 1e-4, a nonlinearity).
_FIT_RTOL = 1e-5
# A row of y - b grown by more than 4 * (1 - _LINEAR) when the input is multiplied by 4 is linear: a norm
# whose eps exceeds ~7.5e6 times the probe input's mean square (about 10) is a constant scale on any input
# a model feeds it, and is not treated as a norm.
_LINEAR = 1e-6


def _close(a: torch.Tensor, b: torch.Tensor, rtol: float = _RTOL) -> bool:
    scale = max(a.abs().max().item(), b.abs().max().item(), 1e-30)
    return bool((a - b).abs().max().item() <= rtol * scale)


def _near(a: torch.Tensor, b: torch.Tensor, scale: float, rtol: float = _RTOL) -> bool:
    """``|a - b| <= rtol * scale`` everywhere (``scale``: the size of the output the difference is in)."""
    return bool((a - b).abs().max().item() <= rtol * max(scale, 1e-300))


def _rows(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Dot products of ``a`` and ``b`` over the last axis, kept as a trailing axis of size 1."""
    return (a * b).sum(-1, keepdim=True)


def _center(x: torch.Tensor, kind: str) -> torch.Tensor:
    x = x.double()
    return x - x.mean(-1, keepdim=True) if kind == "layernorm" else x


def _ms(x: torch.Tensor) -> torch.Tensor:
    return x.pow(2).mean(-1, keepdim=True)


_SPAN = 4  # longest axis of a probe input outside its leading two and the module's parameter axes


def _probe_shapes(module: nn.Module, input_shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    """The input shapes to probe ``module`` on, in the order to try them.

    First the model's rank with 2 x 4 leading rows (8 rows for a 2-D input), the axes the module's
    parameters and buffers cover (their trailing ``ndim`` axes) as in the model, and every other axis cut
    to at most ``_SPAN``. An axis longer than 1 stays longer than 1, so a map over more than the last axis
    still shows; the size stays a few thousand elements (probing costs ~25 calls of the module, and a
    per-head norm traced on 512 tokens has a 512-long axis). Then, only for a module that raises on that
    shape, the shape with every axis after the first two as in the model.
    """
    tensors = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
    keep = max([t.ndim for t in tensors] + [1])
    lead, tail = input_shape[: len(input_shape) - keep], tuple(input_shape[len(input_shape) - keep :])
    if not lead:
        return [tuple(input_shape)]
    if len(lead) == 1:
        return [(8, *tail)]
    short = (2, 4, *(min(d, _SPAN) for d in lead[2:]), *tail)
    full = (2, 4, *input_shape[2:])
    return [short] if short == full else [short, full]


def _broadcasts(param_shape: torch.Size, input_shape: tuple[int, ...]) -> bool:
    """True when ``param_shape`` is a suffix of ``input_shape`` (a per-feature or per-head parameter)."""
    if len(param_shape) == 0 or len(param_shape) > len(input_shape):
        return False
    return tuple(param_shape) == tuple(input_shape[-len(param_shape) :])


def is_candidate(module: nn.Module, input_shape: tuple[int, ...]) -> bool:
    """Cheap static filter applied before probing: a leaf whose tensors all broadcast over the input.

    Args:
        module: the module seen in the trace.
        input_shape: shape of the single tensor it was called with.
    """
    if any(True for child in module.children() for _ in child.parameters()):
        return False
    tensors = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
    return len(tensors) <= 2 and all(
        t.is_floating_point() and _broadcasts(t.shape, input_shape) for t in tensors
    )


class ProbeError(RuntimeError):
    """A norm candidate could not be probed for a reason other than not being a norm (its copy could not be
    made, or it raised on an input of the very shape it took in the model). ``walk`` reports it, never
    drops it silently."""


def _run(module: nn.Module, x: torch.Tensor, strict: bool = False) -> torch.Tensor | None:
    try:
        with torch.no_grad():
            y = module(x)
    except Exception as error:  # noqa: BLE001 - a module that cannot take a probe input is not a norm
        if strict:  # the input has the shape the model called it with: failing on it is unexpected
            first = str(error).splitlines()[0] if str(error) else ""
            raise ProbeError(f"{type(error).__name__}: {first}") from error
        return None
    if not isinstance(y, torch.Tensor) or y.shape != x.shape or not y.is_floating_point():
        return None
    if not torch.isfinite(y).all():
        return None
    return y.double()


def _structure(module: nn.Module, x: torch.Tensor, y: torch.Tensor, keep: int):
    """What every norm does whatever its eps, from ``y = module(x)``, ``module(-x)`` and ``module(4 x)``.

    A norm is odd about its bias: ``y(x) + y(-x) = 2 b``, the same on every row (``b`` spans the trailing
    ``keep`` axes, the parameters' own). Multiplying the input by 4 multiplies each row of ``y - b`` by
    ``lam = 4 sqrt((ms + eps) / (16 ms + eps))``, in ``[1, 4)``: 1 for eps = 0, near 4 where eps dominates
    the mean square ``ms``. Returns ``(b, lam)`` (``b`` of the trailing shape, ``lam`` one per row), or None
    when the module does not behave so, or grows every row by 4 (a linear map, see ``_LINEAR``).
    """
    neg = _run(module, -x)
    if neg is None:
        return None
    size = y.abs().max().item()
    mid = (y + neg) / 2
    tail = mid.shape[mid.ndim - keep :]
    b = mid.reshape(-1, *tail).mean(0)
    if not _near(mid, b.expand_as(mid), size):
        return None
    up = _run(module, x * 4.0)
    if up is None:
        return None
    low, high = y - b, up - b
    den = _rows(low, low)
    if not bool((den > 0).all()):
        return None
    lam = _rows(high, low) / den
    if not _near(high, lam * low, up.abs().max().item()):
        return None
    if not bool((lam >= 1.0 - _RTOL).all()) or bool((lam >= 4.0 * (1.0 - _LINEAR)).all()):
        return None
    return b, lam


def _eps_from_growth(lam: torch.Tensor, ms: torch.Tensor) -> float:
    """A first eps from ``_structure``'s ``lam`` on rows of mean square ``ms``: solving
    ``lam**2 / 16 = (ms + eps) / (16 ms + eps)`` gives ``eps = 16 ms (lam**2 - 1) / (16 - lam**2)``.
    Rough where eps is far below ``ms`` (then ~0) or far above it; enough to choose an input scale."""
    lam2 = lam.pow(2).clamp(1.0, 16.0 * (1.0 - _LINEAR))
    return max(0.0, (16.0 * ms * (lam2 - 1.0) / (16.0 - lam2)).median().item())


def _roles(module: nn.Module, x: torch.Tensor, y: torch.Tensor, c: torch.Tensor, gen: torch.Generator):
    """Perturb each parameter/buffer of ``module`` (a float64 copy) and classify it as scale or bias.

    ``c`` is the input the norm divides (``x``, centered for a LayerNorm). Moving a bias by ``delta`` moves
    the output by ``delta``; moving the scale by ``delta`` moves each row by ``s * delta * c``, ``s`` one
    positive factor per row (``1 / sqrt(ms + eps)``, fitted here, so no eps is assumed). Returns
    ``(scale name, bias name, s)`` (``s`` None without a scale), or None for a tensor of any other role.
    """
    scale = bias = s = None
    named = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
    for name, t in named:
        saved = t.data.clone()
        delta = torch.randn(t.shape, generator=gen, dtype=t.dtype, device=t.device) * 0.25
        # In place on the tensor itself, not through ``.data``: its version counter moves, so a module that
        # caches a property of its weight on it (FusedRMSNorm's identity test) sees the change. An inference
        # tensor has no version counter (and such modules do not cache on it).
        target = t.data if t.is_inference() else t
        with torch.no_grad():
            target.add_(delta)
        moved = _run(module, x)
        with torch.no_grad():
            target.copy_(saved)
        if moved is None:
            return None
        dy = moved - y
        dc = delta.double() * c
        den = _rows(dc, dc)
        factor = _rows(dy, dc) / den.clamp_min(1e-300)
        if _close(dy, delta.expand_as(dy), rtol=1e-3):
            if bias is not None:
                return None
            bias = name
        elif bool((den > 0).all()) and bool((factor > 0).all()) and _close(dy, factor * dc, rtol=1e-3):
            if scale is not None:
                return None
            scale, s = name, factor
        else:  # a tensor that changes the output in any other way: not a plain norm
            return None
    return scale, bias, s


def _measure_eps(module: nn.Module, n: torch.Tensor, w: torch.Tensor, b: torch.Tensor, kind: str = "rmsnorm",
                 dtype: torch.dtype = torch.float64, guess: float = 0.0) -> float:  # fmt: skip
    """Find the eps the module really adds to the mean square (or variance), fed inputs of ``dtype``.

    Feeding ``x = t * n`` (``n``: rows of mean square 1, zero mean for LayerNorm) gives
    ``y - b = w * x / sqrt(ms(x) + eps)``; the ratio ``rho = sqrt(ms / (ms + eps))`` is best conditioned
    where ``ms`` is near eps, so sweep ``t**2`` down by decades, from 1 (or from above ``guess``, a first
    eps, when that is larger) to 1e-16, keep the estimate with rho closest to 1/sqrt(2), and measure once
    more at ``ms`` equal to it. ``x`` is rounded to ``dtype`` first, and ``ms`` and the eps-free
    normalization are taken from the rounded input (in float64), so a half-precision measurement is
    unbiased; its rounding noise averages over the probe's elements (measured: within 1% in bfloat16).
    Returns 0.0 when no input shows an eps (eps 0, or below what ``dtype`` resolves).
    """

    def estimate(t: float) -> tuple[float, float] | None:
        x = (n * t).to(dtype)
        y = _run(module, x)
        if y is None:
            return None
        xd = x.double()
        if kind == "layernorm":
            xd = xd - xd.mean(-1, keepdim=True)
        ms = _ms(xd)
        if not bool((ms > 0).all()):
            return math.nan, 0.0  # the input underflowed in this dtype
        u = w * xd / ms.sqrt()
        rho = ((y - b) * u).sum().item() / u.pow(2).sum().item()
        if not 0.0 < rho <= 1.0 + 1e-9:
            return None
        return rho, ms.mean().item() * (1.0 / (rho * rho) - 1.0)

    top = max(0, math.ceil(math.log10(4.0 * guess))) if guess > 0.25 else 0
    best, best_gap = 0.0, math.inf
    for k in range(-top, 17):
        got = estimate(10.0 ** (-k / 2))
        if got is None:
            continue
        rho, eps = got
        if math.isnan(rho):
            break
        gap = abs(rho - 2**-0.5)
        if gap < best_gap and rho < 0.999:
            best, best_gap = eps, gap
        if rho < 0.2:  # past the well-conditioned range: eps dominates from here on
            break
    if best > 0.0:  # once more where ms equals the estimate: rho = 1/sqrt(2), the best conditioning
        got = estimate(math.sqrt(best))
        if got is not None and not math.isnan(got[0]) and 0.2 <= got[0] < 0.999:
            best = got[1]
    return best


_FLOAT_EPS = tuple(torch.finfo(d).eps for d in (torch.float64, torch.float32, torch.bfloat16, torch.float16))


def _snap_eps(estimate: float, module: nn.Module) -> float:
    """Prefer a float attribute of the module, or the machine epsilon of a float dtype (what ``eps=None``
    adds: ``nn.RMSNorm``), that matches the measured eps within 2%; else round to 3 digits."""
    if estimate <= 0.0:
        return 0.0
    for value in [v for v in vars(module).values() if isinstance(v, float)] + list(_FLOAT_EPS):
        if value > 0 and abs(value - estimate) <= 0.02 * estimate:
            return value
    return float(f"{estimate:.2e}")


def _eps_candidates(estimate: float, module: nn.Module) -> list[float]:
    """The values the eps measured as ``estimate`` may be, in order of preference: what ``_snap_eps``
    gives (a float attribute of the module or a machine epsilon within 2%), the shortest decimal within
    1e-6 of it (the measurement's precision where the module computes in float32: ~1e-7), itself."""
    if estimate <= 0.0:
        return [0.0]
    values = [_snap_eps(estimate, module)]
    for digits in range(17):
        value = float(f"{estimate:.{digits}e}")
        if abs(value - estimate) <= 1e-6 * estimate:
            values.append(value)
            break
    values.append(estimate)
    return list(dict.fromkeys(values))


def _fit_error(module: nn.Module, kind: str, v: torch.Tensor, b: torch.Tensor, eps: float,
               shape: tuple[int, ...], targets: list[float]) -> float:  # fmt: skip
    """Largest difference, relative to the largest output, between ``module`` and the fitted norm
    ``v * c / sqrt(mean(c**2) + eps) + b`` (``c``: the input, centered for a LayerNorm; float64) on fresh
    inputs (rows with non-zero means) of each mean square in ``targets``. ``inf`` when the module fails on
    one."""
    gen = torch.Generator(device="cpu").manual_seed(1)
    z = torch.randn(shape, generator=gen, dtype=torch.float64, device="cpu") * 3
    z = z + 2 * torch.randn((*shape[:-1], 1), generator=gen, dtype=torch.float64, device="cpu")
    base = _ms(_center(z, kind)).mean().item()
    worst = 0.0
    for target in targets:
        x = z * math.sqrt(target / base)
        y = _run(module, x)
        if y is None:
            return math.inf
        c = _center(x, kind)
        fit = v * c / (_ms(c) + eps).sqrt() + b
        worst = max(worst, (y - fit).abs().max().item() / max(y.abs().max().item(), 1e-300))
    return worst


def _in_dtypes(probe: nn.Module, module: nn.Module) -> nn.Module:
    """A copy of the float64 ``probe`` whose tensors have the dtypes of ``module``'s (the model's own)."""
    own = {**dict(module.named_parameters(recurse=False)), **dict(module.named_buffers(recurse=False))}
    low = copy.deepcopy(probe)
    with torch.no_grad():
        for name, t in [*low.named_parameters(recurse=False), *low.named_buffers(recurse=False)]:
            if name in own and t.is_floating_point():
                t.data = t.data.to(own[name].dtype)
    return low


def _run_dtype_eps(probe: nn.Module, module: nn.Module, site: NormSite, n: torch.Tensor,
                   run_dtype: torch.dtype | None) -> float:  # fmt: skip
    """The eps the module adds in the dtype it runs in (``run_dtype``: its input's in the model).

    ``site.eps`` is measured in float64 (precise); the module is measured again on inputs of ``run_dtype``
    with its parameters in their own dtypes. Where the two disagree by more than a factor 2 (far beyond the
    low-precision measurement's error), the eps depends on the dtype -- ``nn.RMSNorm(eps=None)`` adds the
    machine epsilon of its compute type, float32's 1.19e-7 for a bfloat16 input (torch 2.13), where float64
    shows 2.2e-16 -- and the run dtype's measurement is the module's eps.
    """
    eps64 = site.eps
    if run_dtype is None or run_dtype == torch.float64 or not run_dtype.is_floating_point:
        return eps64
    low = _in_dtypes(probe, module)
    one = torch.ones((), dtype=torch.float64, device="cpu")
    w = getattr(low, site.weight).double() + site.offset if site.weight else one
    b = getattr(low, site.bias).double() if site.bias else torch.zeros((), dtype=torch.float64, device="cpu")
    estimate = _measure_eps(low, n, w.double(), b, site.kind, run_dtype, guess=eps64)
    if estimate <= 0.0 or 0.5 * eps64 <= estimate <= 2.0 * eps64:
        return eps64
    return _snap_eps(estimate, module)


def _cast_order(
    module: nn.Module,
    site: NormSite,
    shape: tuple[int, ...],
    gen: torch.Generator,
    low: nn.Module | None = None,
    run_dtype: torch.dtype | None = None,
) -> str:
    """Which of the two cast orders the module follows, bit for bit, in half precision.

    ``"llama"``: normalize in float32, cast to the input dtype, then multiply by the weight (LlamaRMSNorm).
    ``"fp32"``: multiply by the weight in float32 and cast at the end (GemmaRMSNorm, nn.LayerNorm).
    Measured as the module runs in the model when that is half precision (``low``: the module with its own
    parameter dtypes, on ``run_dtype`` inputs), else on a bfloat16 copy (in float32 the two orders agree).
    """
    from normswap.kernels import layer_norm, rms_norm

    if site.weight is None:
        return "fp32"
    half = run_dtype in (torch.bfloat16, torch.float16) and low is not None
    low, dtype = (low, run_dtype) if half else (module.to(torch.bfloat16), torch.bfloat16)
    x = (torch.randn(shape, generator=gen, device="cpu") * 3).to(dtype)
    with torch.no_grad():
        out_dtype = low(x).dtype  # llama order promotes to the weight's dtype (C3): part of the evidence
    y = _run(low, x)
    if y is None:
        return "fp32"
    w = getattr(low, site.weight)
    b = getattr(low, site.bias) if site.bias else None
    best, best_err = "fp32", math.inf
    for order in ("fp32", "llama"):
        if site.kind == "rmsnorm":
            ref = rms_norm(x, w, eps=site.eps, offset=site.offset, cast_order=order, backend="eager")
        else:
            ref = layer_norm(x, w, b, eps=site.eps, offset=site.offset, cast_order=order, backend="eager")
        err = (ref.double() - y).abs().sum().item() if ref.dtype == out_dtype else math.inf
        if err < best_err:
            best, best_err = order, err
    return best


def _compute_dtype(module: nn.Module, site: NormSite, shape: tuple[int, ...], gen: torch.Generator):
    """``"float32"`` when a float64 copy of the module normalizes in float32 (HF's norms upcast with
    ``.to(torch.float32)`` whatever the input dtype), ``None`` when it computes in float64: whichever of the
    two fused modules reproduces its float64 output more closely (ties: ``None``)."""
    from normswap.swap import fused_module

    high = copy.deepcopy(module).double()
    x = torch.randn(shape, generator=gen, dtype=torch.float64, device="cpu") * 3
    y = _run(high, x)
    if y is None:
        return None
    errors = {}
    for compute in (None, "float32"):
        fused = fused_module(dataclasses.replace(site, compute_dtype=compute), high)
        out = _run(fused, x)
        errors[compute] = math.inf if out is None else (out - y).abs().max().item()
    return "float32" if errors["float32"] < errors[None] else None


def nonfinite_tensors(module: nn.Module) -> list[str]:
    """Names of ``module``'s own float parameters and buffers that hold a NaN or inf."""
    named = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
    return [n for n, t in named if t.is_floating_point() and not bool(torch.isfinite(t).all())]


def _finite_copy(module: nn.Module) -> nn.Module:
    """A copy of ``module`` whose non-finite parameter entries hold the median of the finite ones (1.0 if
    none is finite): a norm with a NaN weight is still a norm, and its semantics can still be measured."""
    module = copy.deepcopy(module)
    with torch.no_grad():
        for name in nonfinite_tensors(module):
            t = getattr(module, name)
            bad = ~torch.isfinite(t)
            good = t[~bad]
            t[bad] = good.median() if good.numel() else 1.0
    return module


def probe_module(
    module: nn.Module, input_shape: tuple[int, ...], name: str = "", input_dtype: torch.dtype | None = None
) -> NormSite | None:
    """Decide by probing whether ``module`` is a norm, and measure its semantics.

    Args:
        module: the candidate (never modified; probing runs on float64 and bfloat16 copies).
        input_shape: shape of the tensor the module was called with in the model, ``(..., D)``.
        name: module name, recorded on the site.
        input_dtype: dtype of that tensor (default: the scale parameter's, else float32). eps and the cast
            order are measured as the module computes on inputs of this dtype with its own parameters.

    Returns:
        A ``NormSite`` (consumers empty, not yet foldable) or ``None`` if the module is not a norm over the
        last axis with at most a scale and a bias parameter. Any eps >= 0 is measured (up to ~7.5e7, where
        the norm is a constant scale on every input a model feeds it, see ``_LINEAR``). A norm whose
        parameters hold NaN or inf is probed with those entries replaced by finite ones (``_finite_copy``),
        so it is still found.

    Raises:
        ProbeError: a candidate (a leaf whose tensors broadcast over its input) whose float64 CPU copy
            cannot be made (an offloaded tensor without a value) or raises on a float64 CPU input of every
            shape ``_probe_shapes`` gives (the model's trailing axes): whether it is a norm is unknown, so
            the caller must say so; or a module that is an RMSNorm or LayerNorm far above its eps but that
            no eps reproduces near it (``x / (rms(x) + eps)``, say): a norm that cannot be characterized.
    """
    if not is_candidate(module, input_shape):
        return None
    try:
        probe = cpu_float64_copy(module).eval()
    except ValueError as error:
        raise ProbeError(f"cannot copy it to the CPU: {error}") from error
    if nonfinite_tensors(probe):
        probe = _finite_copy(probe)
    shapes = _probe_shapes(module, input_shape)
    for i, shape in enumerate(shapes):
        gen = torch.Generator(device="cpu").manual_seed(0)
        cpu64 = dict(generator=gen, dtype=torch.float64, device="cpu")
        # Rows with non-zero mean, so RMS-style and mean-subtracting norms differ.
        x = torch.randn(shape, **cpu64) * 3 + torch.randn((*shape[:-1], 1), **cpu64)
        try:
            y = _run(probe, x, strict=True)
            break
        except ProbeError:
            if i == len(shapes) - 1:
                raise
    if y is None:
        return None
    tensors = [*probe.parameters(recurse=False), *probe.buffers(recurse=False)]
    found = _structure(probe, x, y, max([t.ndim for t in tensors] + [1]))
    if found is None:
        return None
    hidden_bias, growth = found
    shifted = _run(probe, x + 7.0 * torch.randn((*shape[:-1], 1), **cpu64))
    kind = "layernorm" if shifted is not None and _close(shifted, y) else "rmsnorm"
    c = _center(x, kind)
    ms = _ms(c)
    guess = _eps_from_growth(growth, ms)
    if guess > ms.mean().item() / 4:  # eps dominates at this scale: probe where the mean square is 4 eps
        t = math.sqrt(4.0 * guess / ms.mean().item())
        x, c, ms = x * t, c * t, ms * (t * t)
        y = _run(probe, x)
        if y is None:
            return None
    roles = _roles(probe, x, y, c, gen)
    if roles is None:
        return None
    scale_name, bias_name, factor = roles
    zero = torch.zeros((), dtype=torch.float64, device="cpu")
    w = getattr(probe, scale_name).double() if scale_name else zero
    b = getattr(probe, bias_name).double() if bias_name else zero
    if bias_name is None and not _near(hidden_bias, zero, y.abs().max().item()):
        return None  # a constant shift held by no tensor: not a norm we can reproduce
    if factor is None:  # parameter-free: the row factor from the first eps (exact enough for the offset)
        factor = 1.0 / (ms + guess).sqrt()
    # offset: y - b = (offset + w) * factor * c, read where |c| is well away from 0.
    mask = c.abs() > 0.5 * ms.sqrt()
    offset = (((y - b) / (factor * c) - w)[mask]).median().item()
    if abs(offset - round(offset)) < 1e-4:
        offset = float(round(offset))
    if scale_name is None and offset != 1.0:
        return None  # a parameter-free map with a hidden constant scale is not a norm we can reproduce
    n = c / ms.sqrt()  # rows of mean square 1 (and zero mean for a LayerNorm)
    measured = _measure_eps(probe, n, offset + w, b, kind, guess=guess)
    # Far above eps (mean square 1e12 eps, where eps moves the output by 5e-13) the module must be the fitted
    # norm, or it is no norm at all; near eps (mean squares eps and 10 eps, and 1) the fit must hold for one
    # of the candidate values. 1e12: a constant c added outside the square root (x / (rms + c)) measures as an
    # eps of at least c**2 ((rms + c)**2 >= ms + c**2), so it moves the output by c / rms <= 1e-6 there,
    # below the tolerance: such a module is a norm that no eps reproduces (``ProbeError``), not silently none.
    if _fit_error(probe, kind, offset + w, b, measured, shape, [max(1.0, 1e12 * measured)]) > _FIT_RTOL:
        return None
    near = [1.0, *((measured, 10 * measured) if measured > 0 else (1e-4, 1e4))]
    error = math.inf
    for eps in _eps_candidates(measured, module):
        error = _fit_error(probe, kind, offset + w, b, eps, shape, near)
        if error <= _FIT_RTOL:
            break
    else:
        raise ProbeError(
            f"a {kind} over its last axis on large inputs, but no eps reproduces it near its eps: with the "
            f"measured eps {measured:.6g} its output is off by {error:.1e} of its size (tolerance "
            f"{_FIT_RTOL:g})"
        )
    run_dtype = input_dtype or (getattr(module, scale_name).dtype if scale_name else torch.float32)
    if scale_name is None:
        offset = 0.0  # parameter-free: y = n, recorded as the w convention with no w
        param_shape = (input_shape[-1],)
    else:
        param_shape = tuple(getattr(module, scale_name).shape)
    ref_tensor = getattr(module, scale_name) if scale_name else None
    site = NormSite(
        name=name,
        kind=kind,
        offset=offset,
        eps=eps,
        weight=scale_name,
        bias=bias_name,
        shape=param_shape,
        cast_order="fp32",
        dtype=str(ref_tensor.dtype).removeprefix("torch.") if ref_tensor is not None else "none",
    )
    site = dataclasses.replace(site, eps=_run_dtype_eps(probe, module, site, n, run_dtype))
    site = dataclasses.replace(site, compute_dtype=_compute_dtype(probe, site, shape, gen))
    low = _in_dtypes(probe, module) if run_dtype in (torch.bfloat16, torch.float16) else None
    # last: it may turn probe to bf16
    return dataclasses.replace(site, cast_order=_cast_order(probe, site, shape, gen, low, run_dtype))
