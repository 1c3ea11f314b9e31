"""What a recorded op means for centering: op classes, argument access, parameter views, replay.

* ``ADD``: sums (and differences) that build a stream; ``SCALE``: multiplications and divisions, exact
  for centering when the factor is constant along the feature axis (``C (a x) = a C x``); ``LINEAR``: the
  ops that write ``W h + c`` into a stream; ``PASS``: value-preserving ops (views, reshapes, transposes,
  slices, casts, dropout in eval) through which a written tensor is followed unchanged.
* ``derive_dims``: the dim map (``dimmap.py``) of a view of a parameter (``W.T``, ``W.view(...)``), so a
  write through it is traced to the parameter's own axis.
* ``replay``: an op applied to a tensor of feature indices instead of values: where each feature of the
  written tensor ends up, hence which features a LayerNorm normalizes together.
"""

from __future__ import annotations

import torch

from normswap import dimmap
from normswap.center.record import Node

ADD = {"add", "add_", "__add__", "__iadd__", "__radd__", "sub", "sub_", "__sub__", "__isub__", "__rsub__"}
SCALE = {"mul", "mul_", "__mul__", "__imul__", "__rmul__", "div", "div_", "__truediv__", "__itruediv__",
         "neg", "__neg__"}  # fmt: skip
LINEAR = {"linear", "matmul", "__matmul__", "mm", "addmm", "bmm"}
PASS = (dimmap.SAME_SHAPE | dimmap.RESHAPE | dimmap.TRANSPOSE | dimmap.SPLIT
        | {"__getitem__", "index_select", "expand", "expand_as", "narrow", "select"})  # fmt: skip


def arg(node: Node, pos: int, name: str, default=None):
    """The argument of ``node``'s call at position ``pos`` or keyword ``name``."""
    return node.args[pos] if len(node.args) > pos else node.kwargs.get(name, default)


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
