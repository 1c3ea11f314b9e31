"""Norm semantics by numerical probing.

A module is a norm if, on inputs shaped like the ones it saw in the model, its output is

    rmsnorm:   y = x / sqrt(mean(x**2) + eps) * (offset + w)            (Zhang & Sennrich, 2019)
    layernorm: y = (x - mean(x)) / sqrt(var(x) + eps) * (offset + w) + b  (Ba et al., 2016)

over the last axis, with ``w`` and ``b`` among its own parameters. Nothing here reads class names, attribute
names or the config: the kind comes from shift invariance, the role of each parameter from how the output
moves when it is perturbed, the offset and eps from fitting the outputs. All probing runs on float64 (and
bfloat16) CPU copies of the module, so the model is never touched and the result does not depend on the
device the model lives on (a norm module is small: the copy costs a few KiB).
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


def _close(a: torch.Tensor, b: torch.Tensor, rtol: float = _RTOL) -> bool:
    scale = max(a.abs().max().item(), b.abs().max().item(), 1e-30)
    return bool((a - b).abs().max().item() <= rtol * scale)


def _normalize(x: torch.Tensor, kind: str, eps: float = 0.0) -> torch.Tensor:
    """float64 reference normalization over the last axis."""
    x = x.double()
    if kind == "layernorm":
        x = x - x.mean(-1, keepdim=True)
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


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


def _roles(module: nn.Module, x: torch.Tensor, y: torch.Tensor, n: torch.Tensor, gen: torch.Generator):
    """Perturb each parameter/buffer of ``module`` (a float64 copy) and classify it as scale or bias."""
    scale = bias = None
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
        if _close(dy, delta * n, rtol=1e-3):
            if scale is not None:
                return None
            scale = name
        elif _close(dy, delta.expand_as(dy), rtol=1e-3):
            if bias is not None:
                return None
            bias = name
        else:  # a tensor that changes the output in any other way: not a plain norm
            return None
    return scale, bias


def _measure_eps(module: nn.Module, n: torch.Tensor, w: torch.Tensor, b: torch.Tensor, kind: str = "rmsnorm",
                 dtype: torch.dtype = torch.float64) -> float:  # fmt: skip
    """Find the eps the module really adds to the mean square (or variance), fed inputs of ``dtype``.

    Feeding ``x = t * n`` (rows of mean square ``t**2``, zero mean for LayerNorm) gives
    ``y - b = w * x / sqrt(ms(x) + eps)``; the ratio ``rho = sqrt(ms / (ms + eps))`` is best conditioned
    where ``ms`` is near eps, so sweep ``t**2`` over 1 .. 1e-16 and keep the estimate with rho closest to
    1/sqrt(2). ``x`` is rounded to ``dtype`` first, and ``ms`` and the eps-free normalization are taken from
    the rounded input (in float64), so a half-precision measurement is unbiased; its rounding noise averages
    over the probe's elements (measured: within 1% in bfloat16).
    """
    best, best_gap = 0.0, math.inf
    for k in range(0, 17):
        t = 10.0 ** (-k / 2)
        x = (n * t).to(dtype)
        y = _run(module, x)
        if y is None:
            break
        xd = x.double()
        if kind == "layernorm":
            xd = xd - xd.mean(-1, keepdim=True)
        ms = xd.pow(2).mean(-1, keepdim=True)
        if not bool((ms > 0).all()):
            break  # the input underflowed in this dtype
        u = w * xd / ms.sqrt()
        rho = ((y - b) * u).sum().item() / u.pow(2).sum().item()
        if not 0.0 < rho <= 1.0 + 1e-9:
            continue
        gap = abs(rho - 2**-0.5)
        if gap < best_gap and rho < 0.999:
            best_gap = gap
            best = ms.mean().item() * (1.0 / (rho * rho) - 1.0)
        if rho < 0.2:  # past the well-conditioned range: eps dominates from here on
            break
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
    estimate = _measure_eps(low, n, w.double(), b, site.kind, run_dtype)
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
        last axis with at most a scale and a bias parameter. A norm whose parameters hold NaN or inf is
        probed with those entries replaced by finite ones (``_finite_copy``), so it is still found.

    Raises:
        ProbeError: a candidate (a leaf whose tensors broadcast over its input) whose float64 CPU copy
            cannot be made (an offloaded tensor without a value) or raises on a float64 CPU input of every
            shape ``_probe_shapes`` gives (the model's trailing axes): whether it is a norm is unknown, so
            the caller must say so.
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
    scaled = _run(probe, x * 4.0)
    if scaled is None or not _close(scaled, y):
        return None
    shifted = _run(probe, x + 7.0 * torch.randn((*shape[:-1], 1), **cpu64))
    kind = "layernorm" if shifted is not None and _close(shifted, y) else "rmsnorm"
    n = _normalize(x, kind)
    roles = _roles(probe, x, y, n, gen)
    if roles is None:
        return None
    scale_name, bias_name = roles
    zero = torch.zeros((), dtype=torch.float64, device="cpu")
    w = getattr(probe, scale_name).double() if scale_name else zero
    b = getattr(probe, bias_name).double() if bias_name else zero
    # offset: y - b = (offset + w) * n, read where |n| is well away from 0.
    mask = n.abs() > 0.5
    offset = (((y - b) / n - w)[mask]).median().item()
    if abs(offset - round(offset)) < 1e-4:
        offset = float(round(offset))
    if scale_name is None and offset != 1.0:
        return None  # a parameter-free map with a hidden constant scale is not a norm we can reproduce
    if not _close((offset + w) * n + b, y, rtol=1e-4):
        return None
    eps = _snap_eps(_measure_eps(probe, n, offset + w, b, kind), module)
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
    site.eps = _run_dtype_eps(probe, module, site, n, run_dtype)
    site.compute_dtype = _compute_dtype(probe, site, shape, gen)
    low = _in_dtypes(probe, module) if run_dtype in (torch.bfloat16, torch.float16) else None
    site.cast_order = _cast_order(probe, site, shape, gen, low, run_dtype)  # last: it may turn probe to bf16
    return site
