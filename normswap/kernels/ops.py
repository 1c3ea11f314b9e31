"""Functional norm ops, registered as ``torch.library`` custom ops, and the choice of backend per call.

Backends (``backend=`` argument, the module's ``backend`` attribute, or the ``NORMSWAP_BACKEND``
environment variable, read once per process, in that order of precedence):

* ``"auto"`` (default): RMSNorm without a weight (the modules drop an identity weight) -> ``"torch"``
  (``F.rms_norm``: one rounding, exact in both cast orders). CUDA -> ``"torch"`` for calls of at most
  ``CUDA_TORCH_MAX`` elements (decode), else ``"triton"`` when triton is installed and the dtypes are half,
  bfloat16 or float32, else ``"torch"``. CPU -> ``"torch"`` for LayerNorm (torch's fused kernel) and for
  RMSNorm calls of at most ``CPU_TORCH_RMS_MAX`` elements, ``"eager"`` for larger RMSNorm calls (compiling
  costs seconds, so it is opt-in).
* ``"eager"``: ``reference.py``, the op sequence of the HF modules.
* ``"torch"``: torch's own ``F.layer_norm`` / ``F.rms_norm``.
* ``"compiled"``: ``torch.compile`` of the reference (``compiled.py``), any device.
* ``"triton"``: hand-written Triton kernels (``triton_norm.py``), CUDA only.

A backend that cannot take a call (triton on CPU, float64, no triton installed) falls back to ``"torch"``
with a warning. Under ``torch.compile``, ``"auto"`` and ``"compiled"`` hand the reference math to the
compiler, which fuses it (and can fuse it with its neighbours); the other backends go through the custom
ops, which the compiler treats as opaque calls with known output shape and dtype (their fake impls), so
there are no graph breaks and no recompiles per norm instance. Calls that need gradients use the
reference math, which autograd differentiates.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import warnings

import torch

from normswap.kernels import reference as ref

BACKENDS = ("auto", "eager", "torch", "compiled", "triton")
ENV_VAR = "NORMSWAP_BACKEND"
_TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_TRITON_MAX_D = 65536  # triton_norm.MAX_D, kept here so the check does not import triton
# On the CPU, auto runs RMSNorm calls of at most this many elements (decode steps) through torch's
# F.rms_norm (llama order: then ``w * y``): ~2 us less per call than the eager op sequence, bit-identical.
CPU_TORCH_RMS_MAX = 16384
# On CUDA, auto runs calls of at most this many elements (decode steps, up to 128 x 8192) through torch's
# kernels, two or three launches of ~10 us each: on the H200 of issue 13 a triton call cost 53-156 us at
# these sizes (its Python launch path), F.rms_norm 18-21 us. `normswap bench --device cuda` times both.
CUDA_TORCH_MAX = 1 << 20


# $NORMSWAP_BACKEND, read once per process at the first call that needs it: a lookup of an unset variable
# raises and catches a KeyError inside os.environ, which cost ~15 us a call on a decode step's cold caches
# (more than the eager norm of one token). ``_ENV.clear()`` makes the next call read it again.
_ENV: list[str] = []


@torch.compiler.assume_constant_result
def _env_backend() -> str:
    if not _ENV:
        _ENV.append(os.environ.get(ENV_VAR, "") or "auto")
    return _ENV[0]


def resolve_backend(backend: str | None) -> str:
    """The backend name a call uses: ``backend`` if given, else ``$NORMSWAP_BACKEND``, else ``"auto"``.

    Raises:
        ValueError: the name is not one of ``BACKENDS``.
    """
    name = backend if backend is not None else _env_backend()
    if name not in BACKENDS:
        source = "backend" if backend is not None else f"${ENV_VAR}"
        raise ValueError(f"{source} must be one of {BACKENDS}, got {name!r}")
    return name


@functools.cache
def _has_triton() -> bool:
    """Whether triton imports (asked only for CUDA tensors, so CPU-only runs never import it)."""
    if importlib.util.find_spec("triton") is None:
        return False
    try:
        import triton.language  # noqa: F401
    except Exception as error:  # a broken install must not break the torch fallback
        warnings.warn(f"normswap: triton does not import ({error}); using torch", stacklevel=2)
        return False
    return True


def _triton_reason(x: torch.Tensor, *params: torch.Tensor | None) -> str | None:
    """Why the triton backend cannot take this call, or None when it can."""
    if x.device.type != "cuda":
        return f"input is on {x.device.type}, triton needs cuda"
    if not _has_triton():
        return "triton is not installed"
    for t in (x, *params):
        if t is not None and t.dtype not in _TRITON_DTYPES:
            return f"dtype {t.dtype} is not one of float16/bfloat16/float32"
    if x.shape[-1] > _TRITON_MAX_D:
        return f"rows of {x.shape[-1]} elements exceed {_TRITON_MAX_D}"
    return None


def _pick(op: str, backend: str, x: torch.Tensor, *params: torch.Tensor | None) -> str:
    """Concrete backend for one call of ``op`` ("rms" or "layer")."""
    if backend == "auto":
        if op == "rms" and all(p is None for p in params):
            # A norm without weight (also an identity weight, which the modules drop): torch's kernel
            # normalizes in float32 and rounds once, which is both cast orders here; fused on CUDA, and
            # on the CPU as fast as the eager math at large sizes and faster per decode call (measured).
            return "torch"
        if x.is_cuda:
            if x.numel() <= CUDA_TORCH_MAX:
                return "torch"
            return "triton" if _triton_reason(x, *params) is None else "torch"
        if op == "rms" and x.is_cpu:
            # F.rms_norm then ``w * y`` is two ops instead of HF's eight: cheaper per decode call,
            # bit-identical on the CPU (measured), no faster at large sizes.
            return "torch" if x.numel() <= CPU_TORCH_RMS_MAX else "eager"
        return "torch"
    if backend == "triton":
        reason = _triton_reason(x, *params)
        if reason is not None:
            warnings.warn(f"normswap: triton backend unavailable ({reason}); using torch", stacklevel=3)
            return "torch"
    return backend


def _kernels(name: str):
    """The module implementing backend ``name`` ("compiled" or "triton"), imported on first use."""
    if name == "compiled":
        from normswap.kernels import compiled

        return compiled
    from normswap.kernels import triton_norm  # imports triton: only reached for CUDA tensors

    return triton_norm


# ---------------------------------------------------------------------------------------------------------
# Implementations: the body of each op. Eager calls run these directly (no dispatcher round trip, which
# costs more than a decode-sized norm); under torch.compile they run behind the custom ops below.


def _rms_impl(x, weight, eps, offset, cast_order, backend):
    name = _pick("rms", backend, x, weight)
    if name == "triton":  # adds the offset in the kernel (no separate launches for prepare_params)
        return _kernels(name).rms_norm(x, weight, eps, cast_order, offset)
    w, _ = ref.prepare_params(weight, None, offset, cast_order)
    if name == "eager":
        return ref.rms_norm_math(x, w, eps, cast_order)
    if name == "torch":
        return ref.rms_norm_torch(x, w, eps, cast_order)
    return _kernels(name).rms_norm(x, w, eps, cast_order)


def _layer_impl(x, weight, bias, eps, offset, cast_order, backend):
    name = _pick("layer", backend, x, weight, bias)
    if name == "triton":
        return _kernels(name).layer_norm(x, weight, bias, eps, cast_order, offset)
    w, b = ref.prepare_params(weight, bias, offset, cast_order)
    if name == "eager":
        return ref.layer_norm_math(x, w, b, eps, cast_order)
    if name == "torch":
        return ref.layer_norm_torch(x, w, b, eps, cast_order)
    return _kernels(name).layer_norm(x, w, b, eps, cast_order)


def _add_rms_impl(x, residual, weight, eps, offset, cast_order, backend):
    name = _pick("rms", backend, x, weight, residual)
    if name == "triton":
        return _kernels(name).add_rms_norm(x, residual, weight, eps, cast_order, offset)
    w, _ = ref.prepare_params(weight, None, offset, cast_order)
    if name == "compiled":
        return _kernels(name).add_rms_norm(x, residual, w, eps, cast_order)
    h = x + residual
    if name == "torch":
        return ref.rms_norm_torch(h, w, eps, cast_order), h
    return ref.rms_norm_math(h, w, eps, cast_order), h


# Custom ops: what torch.compile sees for forced backends. Inputs are made contiguous so that outputs are
# contiguous, as the fake (meta) impls promise.


@torch.library.custom_op("normswap::rms_norm", mutates_args=())
def _rms_norm_op(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float, offset: float, cast_order: str, backend: str
) -> torch.Tensor:
    return _rms_impl(x.contiguous(), weight, eps, offset, cast_order, backend).contiguous()


@_rms_norm_op.register_fake
def _(x, weight, eps, offset, cast_order, backend):
    wdt = None if weight is None else weight.dtype
    return x.new_empty(x.shape, dtype=ref.output_dtype(x.dtype, wdt, None, cast_order))


@torch.library.custom_op("normswap::layer_norm", mutates_args=())
def _layer_norm_op(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    offset: float,
    cast_order: str,
    backend: str,
) -> torch.Tensor:
    return _layer_impl(x.contiguous(), weight, bias, eps, offset, cast_order, backend).contiguous()


@_layer_norm_op.register_fake
def _(x, weight, bias, eps, offset, cast_order, backend):
    wdt = None if weight is None else weight.dtype
    bdt = None if bias is None else bias.dtype
    return x.new_empty(x.shape, dtype=ref.output_dtype(x.dtype, wdt, bdt, cast_order))


@torch.library.custom_op("normswap::add_rms_norm", mutates_args=())
def _add_rms_norm_op(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    offset: float,
    cast_order: str,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    y, h = _add_rms_impl(x.contiguous(), residual.contiguous(), weight, eps, offset, cast_order, backend)
    return y.contiguous(), h.contiguous()


@_add_rms_norm_op.register_fake
def _(x, residual, weight, eps, offset, cast_order, backend):
    hdt = torch.promote_types(x.dtype, residual.dtype)
    wdt = None if weight is None else weight.dtype
    return (
        x.new_empty(x.shape, dtype=ref.output_dtype(hdt, wdt, None, cast_order)),
        x.new_empty(x.shape, dtype=hdt),
    )


# ---------------------------------------------------------------------------------------------------------
# Public functional API.


def _route(backend: str, *tensors: torch.Tensor | None) -> str:
    """ "math": run the reference math inline (autograd differentiates it; a compiler traces and fuses it);
    "op": the custom op (opaque to a compiler); "impl": call the backend directly (eager mode)."""
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        return "math"
    if torch.compiler.is_compiling():
        return "math" if backend in ("auto", "compiled") else "op"
    return "impl"


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    offset: float = 0.0,
    cast_order: str = "llama",
    backend: str | None = None,
) -> torch.Tensor:
    """RMSNorm over the last axis: ``x * rsqrt(mean(x**2) + eps) * (offset + weight)``.

    Zhang & Sennrich (2019); cast orders as transformers' ``LlamaRMSNorm`` (``"llama"``) and
    ``GemmaRMSNorm`` (``"fp32"``), see ``reference.py``.

    Args:
        x: input of shape ``(..., D)``, any floating dtype, any strides.
        weight: scale of shape ``(D,)`` or per-head ``(H, D)`` matching the input's trailing dims, or None.
        eps: added to the mean square.
        offset: 0.0 for ``w`` scales, 1.0 for Gemma's ``(1 + w)``.
        cast_order: ``"llama"`` or ``"fp32"``.
        backend: one of ``BACKENDS``; None reads ``$NORMSWAP_BACKEND``, default ``"auto"``.

    Returns:
        Tensor of ``x``'s shape; dtype ``x.dtype`` in ``"fp32"`` order, the promotion of
        ``weight.dtype`` and ``x.dtype`` in ``"llama"`` order.

    Raises:
        ValueError: bad cast order, backend, dtype or weight shape (see ``reference.check_args``).
    """
    ref.check_args(x, weight, None, offset, cast_order)
    return rms_norm_unchecked(x, weight, eps, offset, cast_order, backend)


def rms_norm_unchecked(x, weight, eps, offset, cast_order, backend):
    """``rms_norm`` without its argument checks, for ``FusedRMSNorm``, whose parameters were checked when it
    was made; an input of the wrong size fails in torch's broadcasting, as in the HF module it replaces.
    The checks cost ~10 us a call on a decode step's cold caches, a sixth of a one-token norm."""
    name = resolve_backend(backend)
    route = _route(name, x, weight)
    if route == "impl":
        return _rms_impl(x, weight, eps, offset, cast_order, name)
    if route == "op":
        return torch.ops.normswap.rms_norm(x, weight, float(eps), float(offset), cast_order, name)
    w, _ = ref.prepare_params(weight, None, offset, cast_order)
    return ref.rms_norm_math(x, w, eps, cast_order)


def layer_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
    offset: float = 0.0,
    cast_order: str = "fp32",
    backend: str | None = None,
) -> torch.Tensor:
    """LayerNorm over the last axis: ``(x - mean) * rsqrt(var + eps) * (offset + weight) + bias``.

    Ba et al. (2016), biased variance as ``nn.LayerNorm``. ``"fp32"`` order is ``nn.LayerNorm`` /
    ``CohereLayerNorm`` / OLMo's parameter-free norm; ``"llama"`` order casts the normalized value to
    ``x.dtype`` before the affine part.

    Args:
        x: input of shape ``(..., D)``, any floating dtype.
        weight, bias: ``(D,)`` or per-head ``(H, D)``, or None.
        eps, offset, cast_order, backend: as in ``rms_norm``.

    Returns:
        Tensor of ``x``'s shape; dtype as in ``rms_norm`` (the bias joins the promotion).

    Raises:
        ValueError: as in ``rms_norm``.
    """
    ref.check_args(x, weight, bias, offset, cast_order)
    return layer_norm_unchecked(x, weight, bias, eps, offset, cast_order, backend)


def layer_norm_unchecked(x, weight, bias, eps, offset, cast_order, backend):
    """``layer_norm`` without its argument checks (``FusedLayerNorm``'s path, see ``rms_norm_unchecked``)."""
    name = resolve_backend(backend)
    route = _route(name, x, weight, bias)
    if route == "impl":
        return _layer_impl(x, weight, bias, eps, offset, cast_order, name)
    if route == "op":
        return torch.ops.normswap.layer_norm(x, weight, bias, float(eps), float(offset), cast_order, name)
    w, b = ref.prepare_params(weight, bias, offset, cast_order)
    return ref.layer_norm_math(x, w, b, eps, cast_order)


def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    offset: float = 0.0,
    cast_order: str = "llama",
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add then RMSNorm, the pre-norm block pattern, in one pass where the backend fuses it.

    Args:
        x: the block output, shape ``(..., D)``.
        residual: the residual stream, same shape as ``x`` (dtypes may differ; they are promoted).
        weight, eps, offset, cast_order, backend: as in ``rms_norm``.

    Returns:
        ``(normed, new_residual)`` with ``new_residual = x + residual`` and
        ``normed = rms_norm(new_residual, ...)``.

    Raises:
        ValueError: ``x`` and ``residual`` differ in shape, or as in ``rms_norm``.
    """
    if x.shape != residual.shape:
        raise ValueError(f"x {tuple(x.shape)} and residual {tuple(residual.shape)} must have the same shape")
    ref.check_args(x, weight, None, offset, cast_order)
    if not residual.is_floating_point():
        raise ValueError(f"residual must be floating point, got {residual.dtype}")
    name = resolve_backend(backend)
    route = _route(name, x, residual, weight)
    if route == "impl":
        return _add_rms_impl(x, residual, weight, eps, offset, cast_order, name)
    if route == "op":
        return torch.ops.normswap.add_rms_norm(
            x, residual, weight, float(eps), float(offset), cast_order, name
        )
    w, _ = ref.prepare_params(weight, None, offset, cast_order)
    h = x + residual
    return ref.rms_norm_math(h, w, eps, cast_order), h
