"""How the axes of a tensor derived by shape-only ops correspond to the axes of the tensor it came from.

A *dim map* is a tuple with one entry per axis of the derived tensor: the index of the base tensor's axis it
is (whole, in order), or ``None`` when it is new, sliced, or a merge of several base axes. The walker keeps
one for every tensor derived from a norm's output (to know where the feature axis went) and for every tensor
derived from a parameter (to know which axis of the parameter an op contracts).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

DimMap = tuple[int | None, ...]

# Ops that return a tensor of the same shape and the same values up to dtype (and up to a scalar factor,
# which commutes with every fold).
SAME_SHAPE = {
    "contiguous", "clone", "detach", "to", "type", "float", "double", "half", "bfloat16", "type_as",
    "requires_grad_", "data", "dropout", "alpha_dropout", "feature_alpha_dropout", "cpu", "cuda",
}  # fmt: skip
RESHAPE = {"view", "reshape", "view_as", "reshape_as", "flatten", "unflatten", "squeeze", "unsqueeze"}
TRANSPOSE = {"transpose", "swapaxes", "swapdims", "t", "T", "mT", "permute"}
SPLIT = {"chunk", "split", "unbind", "tensor_split"}


def identity(ndim: int) -> DimMap:
    return tuple(range(ndim))


def after_reshape(dims: DimMap, before: Sequence[int], after: Sequence[int]) -> DimMap:
    """Row-major reshape: base axis at ``before[j]`` survives as ``after[i]`` when the sizes and the
    products of all trailing sizes agree (that is exactly when the reshape keeps it whole)."""
    out: list[int | None] = [None] * len(after)
    for j, size in enumerate(before):
        if dims[j] is None:
            continue
        tail = math.prod(before[j + 1 :])
        for i, size_out in enumerate(after):
            if size_out == size and math.prod(after[i + 1 :]) == tail and (size > 1 or out[i] is None):
                out[i] = dims[j]
                break
    return tuple(out)


def after_permute(dims: DimMap, order: Sequence[int]) -> DimMap:
    return tuple(dims[k] for k in order)


def after_transpose(dims: DimMap, a: int, b: int) -> DimMap:
    order = list(range(len(dims)))
    order[a], order[b] = order[b], order[a]
    return after_permute(dims, order)


def _is_full(index: slice, size: int) -> bool:
    start, stop, step = index.indices(size)
    return start == 0 and stop == size and step == 1


def after_getitem(dims: DimMap, shape: Sequence[int], index) -> DimMap | None:
    """Dim map after ``tensor[index]``; ``None`` for index forms this module does not follow."""
    if not isinstance(index, tuple):
        index = (index,)
    consumed = sum(
        (i.ndim if isinstance(i, torch.Tensor) and i.dtype == torch.bool else 1)
        for i in index
        if i is not None and i is not Ellipsis
    )
    expanded: list = []
    for i in index:
        if i is Ellipsis:
            expanded.extend([slice(None)] * (len(shape) - consumed))
        else:
            expanded.append(i)
    if not any(i is Ellipsis for i in index):
        expanded.extend([slice(None)] * (len(shape) - consumed))
    out: list[int | None] = []
    axis = 0
    advanced_done = False
    for i in expanded:
        if axis > len(shape):
            return None
        if i is None:
            out.append(None)
        elif isinstance(i, bool):
            return None
        elif isinstance(i, int):
            axis += 1
        elif isinstance(i, slice):
            if axis >= len(shape):
                break
            out.append(dims[axis] if _is_full(i, shape[axis]) else None)
            axis += 1
        elif isinstance(i, torch.Tensor | list):
            if advanced_done:
                return None  # several advanced indices: dims may move; not followed
            t = torch.as_tensor(i)
            advanced_done = True
            if t.dtype == torch.bool:
                out.append(None)
                axis += t.ndim
            else:
                out.extend([None] * t.ndim)
                axis += 1
        else:
            return None
    return tuple(out)
