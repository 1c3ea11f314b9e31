"""Round-to-nearest fake quantization in torch: ``rtn``, the ``FakeQuant`` mode, ``quantized`` (the package
docstring says which ops are quantized and how)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from normswap.quantize import Scheme, get_scheme
from normswap.walk import func_name

_TRANSPOSES = {"t", "T", "mT", "transpose", "permute", "swapaxes", "swapdims"}
_MATMULS = {"matmul", "mm", "__matmul__"}


def rtn(x: torch.Tensor, bits: int, dim: int = -1) -> torch.Tensor:
    """Symmetric round-to-nearest fake quantization of ``x`` with one scale per slice along ``dim``.

    Args:
        x: any floating tensor, any shape.
        bits: ``b >= 2``; values become integers in ``[-L, L]``, ``L = 2^(b-1) - 1``, times the slice's scale
            ``max |x| / L`` (a zero slice stays zero).
        dim: the axis each scale covers (``-1``: one scale per row).

    Returns:
        a tensor of ``x``'s shape, dtype and device. The rounding is computed in float32 (float64 for a
        float64 ``x``), so each value is within half a scale of ``x`` up to that precision.
    """
    levels = 2 ** (bits - 1) - 1
    work = x.to(torch.promote_types(x.dtype, torch.float32))
    scale = work.abs().amax(dim, keepdim=True).clamp(min=torch.finfo(work.dtype).tiny) / levels
    return (torch.round(work / scale).clamp(-levels, levels) * scale).to(x.dtype)


class FakeQuant(TorchFunctionMode):
    """While active, runs every linear op of ``model`` (see the module docstring) on quantized operands.

    Args:
        model: the ``nn.Module`` whose parameters are the weights of the linear ops to quantize; its
            ``get_output_embeddings()`` weight (if any) is left out.
        scheme: a :class:`Scheme`.

    Attributes:
        ops: names of the parameters seen as the weight of a quantized linear op (filled as the forward runs).
    """

    def __init__(self, model: nn.Module, scheme: Scheme):
        super().__init__()
        self.scheme = scheme
        self.names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False) if p.dim() == 2}
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        weight = getattr(head, "weight", None)
        if weight is not None:
            self.names.pop(id(weight), None)
        self.params = {id(p): p for p in model.parameters() if id(p) in self.names}
        self.views: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id -> (transposed view, its param)
        self.cache: dict[tuple[int, bool], torch.Tensor] = {}
        self.ops: set[str] = set()

    def _weight(self, w) -> tuple[torch.Tensor, bool] | None:
        """``(parameter, stored as out x in)`` when ``w`` is a quantized parameter or its transpose, as used
        by a ``x @ w`` (in x out) op."""
        if not isinstance(w, torch.Tensor):
            return None
        if id(w) in self.params:
            return self.params[id(w)], False
        view = self.views.get(id(w))
        if view is not None and view[0] is w:
            return view[1], True
        return None

    def _quantized(self, param: torch.Tensor, w: torch.Tensor, transposed: bool, in_axis: int):
        """``w`` (``param`` or its transpose, as the op uses it), quantized per output channel (one scale per
        slice along ``in_axis``, the op's input axis of ``w``); cached per parameter and layout."""
        bits = self.scheme.weight_bits
        if bits is None:
            return w
        key = (id(param), transposed)
        if key not in self.cache:
            self.cache[key] = rtn(w.detach(), bits, dim=in_axis)
        return self.cache[key]

    def _activation(self, x):
        bits = self.scheme.activation_bits
        if bits is None or not isinstance(x, torch.Tensor) or not x.is_floating_point():
            return x
        return rtn(x, bits, dim=-1)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func_name(func)
        if name == "linear" and len(args) >= 2:
            found = self._weight(args[1])
            if found is not None and found[0] is args[1]:  # F.linear(x, W): W is out x in
                self.ops.add(self.names[id(found[0])])
                w = self._quantized(found[0], args[1], False, 1)
                return func(self._activation(args[0]), w, *args[2:], **kwargs)
        elif name in _MATMULS or name == "addmm":
            at = 1 if name == "addmm" else 0  # addmm(bias, x, W)
            found = self._weight(args[at + 1]) if len(args) >= at + 2 else None
            if found is not None:  # x @ W: W (or W.t()) is in x out
                self.ops.add(self.names[id(found[0])])
                new = list(args)
                new[at] = self._activation(args[at])
                new[at + 1] = self._quantized(found[0], args[at + 1], found[1], 0)
                return func(*new, **kwargs)
        out = func(*args, **kwargs)
        if name in _TRANSPOSES and args and id(args[0]) in self.params and isinstance(out, torch.Tensor):
            if out.dim() == 2 and out.shape == args[0].shape[::-1]:
                self.views[id(out)] = (out, args[0])
        return out

    def __exit__(self, *exc):
        self.views.clear()
        return super().__exit__(*exc)


@contextlib.contextmanager
def quantized(model: nn.Module, scheme: Scheme | str) -> Iterator[FakeQuant]:
    """Context: every forward of ``model`` inside it runs with ``scheme``'s fake quantization; ``model``
    itself is not changed (a weight scheme's quantized weights are dropped on exit).

    Yields:
        the :class:`FakeQuant` mode (its ``ops`` name the linear ops quantized so far).

    Raises:
        NormswapError: unknown scheme name.
    """
    scheme = get_scheme(scheme) if isinstance(scheme, str) else scheme
    mode = FakeQuant(model, scheme)
    try:
        with mode:
            yield mode
    finally:
        mode.cache.clear()
