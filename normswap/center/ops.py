"""What a recorded op means for centering: op classes, argument access, parameter views, replay.

* ``ADD``: sums (and differences) that build a stream; ``SCALE``: multiplications and divisions, exact
  for centering when the factor is constant along the feature axis (``C (a x) = a C x``); ``LINEAR``: the
  ops that write ``W h + c`` into a stream; ``PASS``: value-preserving ops (views, reshapes, transposes,
  slices, casts, dropout in eval) through which a written tensor is followed unchanged.
* ``ROWSUM``: sums of whole rows along an axis other than the features (``x.sum(dim=1)`` over the routed
  experts of a token, ``out.index_add_(0, token_idx, expert_out)``, ``scatter_add`` of whole rows):
  each output row is a sum of input rows, so a sum of writes stays a sum of writes (``C`` acts on each row);
  ``ZEROS``: a tensor of zeros (``torch.zeros_like(x)``, the start of such an accumulation) writes nothing.
* ``derive_dims``: the dim map (``dimmap.py``) of a view of a parameter (``W.T``, ``W.view(...)``), so a
  write through it is traced to the parameter's own axis.
* ``replay``: an op applied to a tensor of feature indices instead of values: where each feature of the
  written tensor ends up, hence which features a LayerNorm normalizes together.
"""

from __future__ import annotations

import torch

from normswap import dimmap
from normswap.recording import ZEROS, Node  # noqa: F401 - ZEROS is part of ops

ADD = {"add", "add_", "__add__", "__iadd__", "__radd__", "sub", "sub_", "__sub__", "__isub__", "__rsub__"}
SCALE = {"mul", "mul_", "__mul__", "__imul__", "__rmul__", "div", "div_", "__truediv__", "__itruediv__",
         "neg", "__neg__"}  # fmt: skip
LINEAR = {"linear", "matmul", "__matmul__", "mm", "addmm", "bmm", "_grouped_mm", "grouped_mm",
          "grouped_mm_fallback"}  # fmt: skip
ROWSUM = {"sum", "index_add", "index_add_", "scatter_add", "scatter_add_"}
PASS = (dimmap.SAME_SHAPE | dimmap.RESHAPE | dimmap.TRANSPOSE | dimmap.SPLIT
        | {"__getitem__", "index_select", "expand", "expand_as", "narrow", "select"})  # fmt: skip


def arg(node: Node, pos: int, name: str, default=None):
    """The argument of ``node``'s call at position ``pos`` or keyword ``name``."""
    return node.args[pos] if len(node.args) > pos else node.kwargs.get(name, default)


def rowsum_parts(node: Node) -> tuple[list, str | None]:
    """The operand keys whose rows ``node`` (a ``ROWSUM`` op) sums, and why not when it mixes features.

    Returns ``(keys, None)`` when every output row is a sum of whole input rows, else ``([], reason)``.
    """
    out_last = node.out.ndim - 1
    if node.op == "sum":
        src = node.args[0]
        dims = arg(node, 1, "dim")
        if dims is None or src.ndim == 0:
            return [], "sums over every axis, features included"
        dims = [dims] if isinstance(dims, int) else list(dims)
        if src.ndim - 1 in [d % src.ndim for d in dims]:
            return [], "sums over the feature axis"
        return [node.operands[0]], None
    dim = arg(node, 1, "dim") % node.out.ndim
    if dim == out_last:
        return [], "accumulates along the feature axis"
    if node.op.startswith("scatter_add"):
        index = arg(node, 2, "index")
        if index.shape[-1] != node.out.shape[-1] or not bool((index == index[..., :1]).all()):
            return [], "scatters features to different rows"
        source = node.operands.get(3, node.operands.get("src"))
    else:
        source = node.operands.get(3, node.operands.get("source"))
    return [k for k in (node.operands.get(0, node.operands.get("input")), source) if k is not None], None


def dropout_active(node: Node) -> bool:
    """``F.dropout(input, p=0.5, training=True)`` as called: does it drop anything?"""
    return bool(arg(node, 2, "training", True)) and arg(node, 1, "p", 0.5) > 0


def where(node: Node) -> str:
    """``"op in module"`` for messages."""
    return f"{node.op} in {node.module}" if node.module else node.op


def derive_dims(node: Node, dims: dimmap.DimMap) -> dimmap.DimMap | None:
    """Dim map of ``node.out`` given the dim map of its first argument (a parameter view), or None."""
    name, src, out = node.op, node.args[0], node.out
    if name == "view" and any(isinstance(a, torch.dtype) for a in node.args[1:]):
        return None  # a reinterpreting view, not a reshape
    if name in dimmap.SAME_SHAPE:
        return dims if out.shape == src.shape else None
    if name in dimmap.RESHAPE:
        return dimmap.after_reshape(dims, src.shape, out.shape)
    if name in ("t", "T"):
        return dims[::-1] if src.ndim <= 2 else None
    if name == "mT":
        return dimmap.after_transpose(dims, src.ndim - 2, src.ndim - 1)
    if name in ("transpose", "swapaxes", "swapdims"):
        a, b = arg(node, 1, "dim0"), arg(node, 2, "dim1")
        return dimmap.after_transpose(dims, a % src.ndim, b % src.ndim)
    if name == "permute":
        order = node.args[1:] if len(node.args) > 2 else (arg(node, 1, "dims"))
        return dimmap.after_permute(dims, [o % src.ndim for o in order])
    if name == "__getitem__":
        return dimmap.after_getitem(dims, src.shape, node.args[1])
    return None


def replay(node: Node, index: torch.Tensor) -> torch.Tensor:
    """``node``'s op applied to a tensor of feature indices standing in for its first argument."""
    if node.op in dimmap.SAME_SHAPE or node.op in SCALE:
        return index.expand(node.out.shape)
    try:
        result = node.func(index, *node.args[1:], **node.kwargs)
    except RuntimeError:  # a view the broadcast (stride-0) index tensor cannot take: use a real copy
        result = node.func(index.contiguous(), *node.args[1:], **node.kwargs)
    return result[node.piece] if node.piece is not None else result
