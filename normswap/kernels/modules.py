"""``FusedRMSNorm`` and ``FusedLayerNorm``: drop-in modules over the functional ops.

Each keeps the parameter names of the module it replaces (``weight_name``/``bias_name``), so state-dict
keys do not change, and reproduces its cast order and output dtype (see ``reference.py``).
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch import nn

from normswap.kernels import ops
from normswap.kernels.reference import CAST_ORDERS, prepare_params

_NATIVE_LN_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class _FusedNorm(nn.Module):
    kind = ""

    def __init__(
        self,
        shape,
        eps: float,
        offset: float,
        cast_order: str,
        weight_name: str | None,
        bias_name: str | None,
        device=None,
        dtype=None,
        backend: str | None = None,
        compute_dtype: str | None = None,
    ) -> None:
        super().__init__()
        shape = (shape,) if isinstance(shape, int) else tuple(int(s) for s in shape)
        if not shape or any(s <= 0 for s in shape):
            raise ValueError(f"norm shape must be (D,) or (H, D) with positive sizes, got {shape}")
        if cast_order not in CAST_ORDERS:
            raise ValueError(f"cast_order must be one of {CAST_ORDERS}, got {cast_order!r}")
        if weight_name is None and offset != 0.0:
            raise ValueError(f"offset={offset} needs a weight; a parameter-free norm has offset 0")
        if backend is not None:
            ops.resolve_backend(backend)
        if compute_dtype not in (None, "float32"):
            raise ValueError(f"compute_dtype must be None or 'float32', got {compute_dtype!r}")
        self.shape = shape
        self.normalized_shape = (shape[-1],)
        self.eps = float(eps)
        self.offset = float(offset)
        self.cast_order = cast_order
        self.weight_name = weight_name
        self.bias_name = bias_name
        self.backend = backend
        self.compute_dtype = compute_dtype
        factory = {"device": device, "dtype": dtype}
        if weight_name is not None:
            self.register_parameter(weight_name, nn.Parameter(torch.empty(shape, **factory)))
        if bias_name is not None:
            self.register_parameter(bias_name, nn.Parameter(torch.empty(shape, **factory)))
        self._identity_key: tuple | None = None  # see _identity_weight
        self._identity_ref = None  # weak reference to the tensor the key was taken from
        self._identity = False
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Identity parameters: weight ``1 - offset`` (so ``offset + w == 1``), bias 0."""
        with torch.no_grad():
            if self.weight_name is not None:
                getattr(self, self.weight_name).fill_(1.0 - self.offset)
            if self.bias_name is not None:
                getattr(self, self.bias_name).zero_()

    def _params(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        w = getattr(self, self.weight_name) if self.weight_name is not None else None
        b = getattr(self, self.bias_name) if self.bias_name is not None else None
        return w, b

    def _identity_weight(self, w: torch.Tensor) -> bool:
        """Whether ``offset + w`` is exactly 1 everywhere (in the dtype the cast order multiplies in), so
        the norm may drop its weight: ``1 * v`` is exact in both cast orders.

        Decided once per state of the weight and cached under ``(w._version, w.data_ptr(), dtype,
        device)``: every in-place edit (an optimizer step, ``load_state_dict``, ``fill_`` under no_grad)
        bumps the version counter and ``.to()``/``module.weight = ...`` change the pointer, so the answer
        is recomputed (one reduction and, on CUDA, one synchronization) after a change and costs one tuple
        comparison otherwise. Edits through ``weight.data`` bypass the version counter: after those, call
        ``reset_identity_cache()``. Inference tensors (parameters made under ``torch.inference_mode``) have
        no version counter: for them the answer is always False (the weight is used). The key is only
        trusted for the very tensor it was taken from (a weak reference): a new parameter that the allocator
        placed where a freed one was, with the same version 0, is decided afresh.
        """
        if w.is_inference():
            return False
        key = (w._version, w.data_ptr(), w.dtype, w.device)
        if key != self._identity_key or self._identity_ref is None or self._identity_ref() is not w:
            eff, _ = prepare_params(w, None, self.offset, self.cast_order)
            with torch.no_grad():
                self._identity = bool((eff == 1).all())
            self._identity_key, self._identity_ref = key, weakref.ref(w)
        return self._identity

    def __getstate__(self):  # pickle / deepcopy: a weak reference cannot be pickled; the copy decides afresh
        state = self.__dict__.copy()
        state["_identity_key"] = state["_identity_ref"] = None
        return state

    def reset_identity_cache(self) -> None:
        """Forget whether the weight is the identity (needed only after edits through ``weight.data``)."""
        self._identity_key = self._identity_ref = None

    def _precision(self, x: torch.Tensor, w: torch.Tensor | None, b: torch.Tensor | None):
        """``(x, w, b, back)`` as the op should see them: for a float64 input of a module that computes in
        float32 (``compute_dtype="float32"``, as HF's ``LlamaRMSNorm``/``GemmaRMSNorm``), ``x`` in float32,
        the parameters in float32 where the cast order multiplies in float32 (``"fp32"``), and
        ``back = torch.float64``, the dtype to return; otherwise everything unchanged and ``back=None``."""
        if self.compute_dtype != "float32" or x.dtype != torch.float64:
            return x, w, b, None
        if self.cast_order == "fp32":
            w = None if w is None else w.float()
            b = None if b is None else b.float()
        return x.float(), w, b, x.dtype

    def extra_repr(self) -> str:
        s = f"{self.shape}, eps={self.eps}, offset={self.offset}, cast_order={self.cast_order!r}"
        if self.weight_name != "weight":
            s += f", weight_name={self.weight_name!r}"
        if self.kind == "layernorm" and self.bias_name != "bias":
            s += f", bias_name={self.bias_name!r}"
        if self.backend is not None:
            s += f", backend={self.backend!r}"
        if self.compute_dtype is not None:
            s += f", compute_dtype={self.compute_dtype!r}"
        return s


class FusedRMSNorm(_FusedNorm):
    """RMSNorm over the last axis with the semantics of the module it replaces.

    ``y = x * rsqrt(mean(x**2) + eps) * (offset + weight)`` in cast order ``"llama"`` (as
    ``LlamaRMSNorm``) or ``"fp32"`` (as ``GemmaRMSNorm``); see ``normswap.kernels.rms_norm``.

    Args:
        shape: the scale's shape, ``(D,)`` or per-head ``(H, D)`` (an int means ``(D,)``).
        eps: epsilon added to the mean square.
        offset: 0.0, or 1.0 for Gemma's ``(1 + w)``.
        cast_order: ``"llama"`` or ``"fp32"``.
        weight_name: attribute name of the scale parameter; None for a parameter-free norm.
        device, dtype: of the parameter (initialized to the identity, ``1 - offset``).
        backend: force a backend (see ``ops.BACKENDS``); None = ``$NORMSWAP_BACKEND`` or ``"auto"``.
        compute_dtype: ``"float32"`` to normalize float64 inputs in float32 as HF's norms do (their
            ``.to(torch.float32)``), returning float64; ``None`` computes float64 inputs in float64.

    Forward: ``x`` of shape ``(..., D)`` (trailing dims matching ``shape``) -> same shape; dtype as
    ``rms_norm``.

    Raises:
        ValueError: bad shape, cast order, backend, or an offset without a weight.
    """

    kind = "rmsnorm"

    def __init__(
        self,
        shape,
        eps: float,
        offset: float = 0.0,
        cast_order: str = "llama",
        weight_name: str | None = "weight",
        device=None,
        dtype=None,
        backend: str | None = None,
        compute_dtype: str | None = None,
    ) -> None:
        super().__init__(
            shape, eps, offset, cast_order, weight_name, None, device, dtype, backend, compute_dtype
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self._parameters.get(self.weight_name) if self.weight_name is not None else None
        if w is None and self.weight_name is not None:  # replaced by a plain tensor or buffer
            w = getattr(self, self.weight_name)
        back = None
        if self.compute_dtype is not None and x.dtype == torch.float64:
            x, w, _, back = self._precision(x, w, None)
        if (
            w is not None
            and not (w.requires_grad and torch.is_grad_enabled())  # autograd needs the weight
            and not torch.compiler.is_compiling()  # the compiler sees the weight (no data-dependent branch)
            and self._identity_weight(w)
        ):
            # Folded models hold weight 1 (or 0 with offset 1) in most norms: the weight-free norm is the
            # same numbers (1 * v is exact) and runs torch's fused kernel under "auto" (ops._pick).
            y = ops.rms_norm_unchecked(x, None, self.eps, 0.0, self.cast_order, self.backend)
            if self.cast_order == "llama" and w.dtype != y.dtype:
                y = y.to(torch.promote_types(y.dtype, w.dtype))
        else:
            y = ops.rms_norm_unchecked(x, w, self.eps, self.offset, self.cast_order, self.backend)
        return y if back is None else y.to(back)


class FusedLayerNorm(_FusedNorm):
    """LayerNorm over the last axis with the semantics of the module it replaces.

    ``y = (x - mean) * rsqrt(var + eps) * (offset + weight) + bias`` (biased variance) in cast order
    ``"fp32"`` (as ``nn.LayerNorm``, ``CohereLayerNorm``, OLMo's parameter-free norm) or ``"llama"``.

    Args:
        shape, eps, offset, cast_order, weight_name, device, dtype, backend, compute_dtype: as
            ``FusedRMSNorm``.
        bias_name: attribute name of the bias parameter; None when the module has no bias.

    Raises:
        ValueError: as ``FusedRMSNorm``.
    """

    kind = "layernorm"

    def __init__(
        self,
        shape,
        eps: float,
        offset: float = 0.0,
        cast_order: str = "fp32",
        weight_name: str | None = "weight",
        bias_name: str | None = "bias",
        device=None,
        dtype=None,
        backend: str | None = None,
        compute_dtype: str | None = None,
    ) -> None:
        super().__init__(
            shape, eps, offset, cast_order, weight_name, bias_name, device, dtype, backend, compute_dtype
        )

    def _native_ok(self, x: torch.Tensor) -> bool:
        """Whether this call is exactly ``nn.LayerNorm``'s: "fp32" order, no offset, ``(D,)`` parameters of
        ``x``'s dtype (half, bfloat16, float32), backend ``auto``, eager mode; on CUDA decode-sized calls
        only (``ops.CUDA_TORCH_MAX``; larger ones go to triton)."""
        if self.cast_order != "fp32" or self.offset != 0.0 or len(self.shape) != 1:
            return False
        if self.weight_name is None:
            return False
        p = self._parameters
        w = p.get(self.weight_name)
        dt = x.dtype
        if w is None or w.dtype != dt or dt not in _NATIVE_LN_DTYPES:
            return False
        if self.bias_name is not None:
            b = p.get(self.bias_name)
            if b is None or b.dtype != dt:
                return False
        return (
            (x.is_cpu or x.numel() <= ops.CUDA_TORCH_MAX)
            and (self.backend or ops._env_backend()) == "auto"
            and not torch.compiler.is_compiling()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._native_ok(x):
            # nn.LayerNorm's own call (the same kernel on the same arguments, so bit-identical to it)
            # without the op layer's per-call work: a decode-sized CPU call costs ~5 us, the op path ~11 us.
            p = self._parameters
            b = p[self.bias_name] if self.bias_name is not None else None
            return F.layer_norm(x, self.normalized_shape, p[self.weight_name], b, self.eps)
        w, b = self._params()
        x, w, b, back = self._precision(x, w, b)
        y = ops.layer_norm_unchecked(x, w, b, self.eps, self.offset, self.cast_order, self.backend)
        return y if back is None else y.to(back)
