"""``FusedRMSNorm`` and ``FusedLayerNorm``: drop-in modules over the functional ops.

Each keeps the parameter names of the module it replaces (``weight_name``/``bias_name``), so state-dict
keys do not change, and reproduces its cast order and output dtype (see ``reference.py``).

A folded RMSNorm (its scale multiplied into its consumers) is built with ``identity_weight=True``: its
weight is the identity by construction, so the module holds no weight tensor and runs the weight-free norm
(one rounding of ``x * rsqrt(mean(x**2) + eps)``, which ``1 * v`` leaves exact in both cast orders). This is
a fact about the module's structure, decided when it is built, never a cached answer about a tensor's
values: nothing an optimizer, a ``.data`` edit or ``load_state_dict`` does can make it stale. The state
dict still carries ``weight_name`` (the identity), so a checkpoint keeps the replaced module's keys and
loads in plain transformers; loading a state dict whose value there is not the identity gives the module
a real weight again (``_load_from_state_dict``), and ``add_weight()`` gives it a trainable one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from normswap.kernels import ops
from normswap.kernels.reference import CAST_ORDERS

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
        identity_weight: bool = False,
    ) -> None:
        super().__init__()
        shape = (shape,) if isinstance(shape, int) else tuple(int(s) for s in shape)
        if not shape or any(s <= 0 for s in shape):
            raise ValueError(f"norm shape must be (D,) or (H, D) with positive sizes, got {shape}")
        if cast_order not in CAST_ORDERS:
            raise ValueError(f"cast_order must be one of {CAST_ORDERS}, got {cast_order!r}")
        if weight_name is None and offset != 0.0:
            raise ValueError(f"offset={offset} needs a weight; a parameter-free norm has offset 0")
        if identity_weight and (weight_name is None or bias_name is not None):
            raise ValueError("identity_weight=True needs a weight_name and no bias (a folded RMSNorm)")
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
        # The dtype and device the identity weight would have (its state-dict entry, llama order's output
        # dtype); kept in step with .to()/.half()/.cuda() by _apply.
        self._identity_dtype = dtype if dtype is not None else torch.get_default_dtype()
        self._identity_device = torch.device(device) if device is not None else torch.get_default_device()
        self.identity_weight = bool(identity_weight)
        factory = {"device": device, "dtype": dtype}
        if weight_name is not None and not identity_weight:
            self.register_parameter(weight_name, nn.Parameter(torch.empty(shape, **factory)))
        if bias_name is not None:
            self.register_parameter(bias_name, nn.Parameter(torch.empty(shape, **factory)))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Identity parameters: weight ``1 - offset`` (so ``offset + w == 1``), bias 0."""
        with torch.no_grad():
            if self.weight_name is not None and not self.identity_weight:
                getattr(self, self.weight_name).fill_(1.0 - self.offset)
            if self.bias_name is not None:
                getattr(self, self.bias_name).zero_()

    def _params(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        w = getattr(self, self.weight_name) if self.weight_name is not None else None
        b = getattr(self, self.bias_name) if self.bias_name is not None else None
        return w, b

    # -- the identity weight: structure, not a cached answer ------------------------------------------------
    def identity_tensor(self) -> torch.Tensor:
        """A new tensor holding the identity weight ``1 - offset``: ``shape``, in the dtype and on the device
        the module's weight would have. What ``state_dict()`` holds under ``weight_name`` when
        ``identity_weight`` is True."""
        value = 1.0 - self.offset
        return torch.full(self.shape, value, dtype=self._identity_dtype, device=self._identity_device)

    def add_weight(self) -> nn.Parameter:
        """Give a module built with ``identity_weight=True`` its identity weight as a trainable Parameter.

        Afterwards the module multiplies by that weight on every call (one more op per call), so
        fine-tuning, optimizers and in-place edits reach it as they would reach the replaced module's.
        Returns the Parameter (the existing weight if the module already has one).

        Raises:
            AttributeError: the module has no weight at all (a parameter-free norm).
        """
        if self.weight_name is None:
            raise AttributeError(f"{type(self).__name__} is parameter-free: it has no weight to add")
        if self.identity_weight:
            setattr(self, self.weight_name, nn.Parameter(self.identity_tensor()))
        return getattr(self, self.weight_name)

    def _leave_identity(self, name: str) -> None:
        if name == self.__dict__.get("weight_name") and self.__dict__.get("identity_weight"):
            self.__dict__["identity_weight"] = False

    def __setattr__(self, name: str, value) -> None:
        self._leave_identity(name)  # module.weight = ...: the module has a weight from now on
        super().__setattr__(name, value)

    def register_parameter(self, name: str, param) -> None:
        self._leave_identity(name)
        super().register_parameter(name, param)

    def register_buffer(self, name: str, tensor, persistent: bool = True) -> None:
        self._leave_identity(name)
        super().register_buffer(name, tensor, persistent)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            d = self.__dict__
            if d.get("identity_weight") and name == d.get("weight_name"):
                raise AttributeError(
                    f"{type(self).__name__}.{name}: this folded norm holds no weight (its scale was "
                    "multiplied into the layers that read it; the identity is what its state dict stores); "
                    "call add_weight() to give it a trainable one"
                ) from None
            raise

    def _apply(self, fn, recurse: bool = True):
        if self.identity_weight:
            moved = fn(torch.empty(0, dtype=self._identity_dtype, device=self._identity_device))
            self._identity_dtype, self._identity_device = moved.dtype, moved.device
        return super()._apply(fn, recurse)

    def _save_to_state_dict(self, destination, prefix: str, keep_vars: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.identity_weight:
            destination[prefix + self.weight_name] = self.identity_tensor()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs) -> None:  # fmt: skip
        key = prefix + self.weight_name if self.weight_name is not None else None
        identity = self.identity_weight
        if identity and key in state_dict:
            value = state_dict[key]
            if not isinstance(value, torch.Tensor) or tuple(value.shape) != self.shape:
                shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
                error_msgs.append(
                    f"size mismatch for {key}: copying a param with shape {shape} from checkpoint, the shape "
                    f"in current model is {self.shape}."
                )
            elif not bool((value == 1.0 - self.offset).all()):  # a weight that is not the identity: keep it
                self.add_weight()
                identity = False
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
        if identity:
            if key in unexpected_keys:
                unexpected_keys.remove(key)
            if key not in state_dict and strict:
                missing_keys.append(key)

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
        if self.identity_weight:
            s += ", identity_weight=True"
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
        identity_weight: the weight is the identity by construction (a folded norm): no weight tensor is
            held and the weight-free norm runs; ``dtype``/``device`` are those the weight would have (the
            llama order's output dtype, the state dict's entry). See the module docstring.

    Forward: ``x`` of shape ``(..., D)`` (trailing dims matching ``shape``) -> same shape; dtype as
    ``rms_norm``.

    Raises:
        ValueError: bad shape, cast order, backend, an offset without a weight, or ``identity_weight``
            without a weight.
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
        identity_weight: bool = False,
    ) -> None:
        super().__init__(
            shape, eps, offset, cast_order, weight_name, None, device, dtype, backend, compute_dtype,
            identity_weight,
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.identity_weight:
            # A folded norm: its weight is the identity by construction (not stored), so the weight-free norm
            # is the same numbers (1 * v is exact) and runs torch's fused kernel under "auto" (ops._pick).
            back = None
            if self.compute_dtype is not None and x.dtype == torch.float64:
                x, back = x.float(), x.dtype
            y = ops.rms_norm_unchecked(x, None, self.eps, 0.0, self.cast_order, self.backend)
            if back is not None:
                return y.to(back)
            if self.cast_order == "llama" and self._identity_dtype != y.dtype:  # promotes as w * y would
                y = y.to(torch.promote_types(y.dtype, self._identity_dtype))
            return y
        w = self._parameters.get(self.weight_name) if self.weight_name is not None else None
        if w is None and self.weight_name is not None:  # replaced by a plain tensor or buffer
            w = getattr(self, self.weight_name)
        back = None
        if self.compute_dtype is not None and x.dtype == torch.float64:
            x, w, _, back = self._precision(x, w, None)
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
