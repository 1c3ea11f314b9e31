"""The fold plan of ``normswap.fold`` as operations on checkpoint tensors, and the output shard layout.

``normswap.fold.fold_site`` changes Parameters in memory; here the same arithmetic (``scale_axis_``,
``bias_delta``, the identity fill) is applied to each tensor as it is read from a shard, so the written
tensors are bit-identical to what the in-memory path saves.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from normswap.errors import NormswapError
from normswap.fold import FoldPlan, bias_delta, distinct_consumers, scale_and_shift, scale_axis_
from normswap.stream.model import Streamed
from normswap.stream.shards import CheckpointReader


@dataclass
class TensorPlan:
    """How one output tensor is made from a checkpoint tensor.

    Attributes:
        source: the checkpoint tensor it is read from.
        scales: ``(axis, float64 scale)`` to multiply in, in order (``fold.scale_axis_``).
        shift: ``(weight's output name, float64 norm bias, axis)`` whose ``W b`` this bias absorbs.
        fill: the norm identity value (``1 - offset`` for a weight, 0 for a bias), or None.
    """

    source: str
    scales: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    shift: list[tuple[str, torch.Tensor, int]] = field(default_factory=list)
    fill: float | None = None


def tensor_plans(streamed: Streamed, folding: FoldPlan, untied: list[str]) -> dict[str, TensorPlan]:
    """One ``TensorPlan`` per output tensor: every checkpoint tensor, plus each untied Parameter (read from
    the tensor it was tied to), with ``folding``'s sites applied.

    Raises:
        NormswapError: a plan this module does not reproduce exactly (one weight scaled along two axes
            while its bias absorbs a shift).
    """
    keys = streamed.keys
    plans = {name: TensorPlan(name) for name in streamed.reader.tensors}
    for name in untied:
        plans[name] = TensorPlan(keys[name])

    def out(param: str) -> str:
        return param if param in untied else keys[param]

    for site in folding.sites:
        norm = streamed.model.get_submodule(site.name)
        scale, shift = scale_and_shift(site, norm)
        for c in distinct_consumers(site):
            weight = plans[out(c.param)]
            if shift is not None and c.bias is not None:
                if weight.scales:
                    raise NormswapError(f"{site.name}: {c.param} is scaled twice before its bias absorbs W b")
                plans[out(c.bias)].shift.append((out(c.param), shift, c.axis))
            weight.scales.append((c.axis, scale))
        if site.weight:
            plans[keys[f"{site.name}.{site.weight}"]].fill = 1.0 - site.offset
        if site.bias:
            plans[keys[f"{site.name}.{site.bias}"]].fill = 0.0
    return plans


def output_dtype(reader: CheckpointReader, name: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype a checkpoint tensor is converted in: ``dtype`` for floating tensors, its own otherwise."""
    own = reader.tensors[name].dtype
    return dtype if own.is_floating_point else own


def layout(reader: CheckpointReader, plans: dict[str, TensorPlan], dtype: torch.dtype):
    """``{file: [(name, dtype, shape), ...]}``: the input's shard files and order; each untied tensor goes
    right after the tensor it was read from."""
    extra: dict[str, list[str]] = {}
    for name, tp in plans.items():
        if name not in reader.tensors:
            extra.setdefault(tp.source, []).append(name)
    files = {}
    for file in reader.files:
        entries = []
        for name in reader.names_in(file):
            for n in [name, *extra.get(name, [])]:
                source = plans[n].source
                entries.append((n, output_dtype(reader, source, dtype), reader.tensors[source].shape))
        files[file] = entries
    return files


@torch.no_grad()
def make_tensor(reader: CheckpointReader, plans: dict[str, TensorPlan], name: str, dtype: torch.dtype,
                device: torch.device | str = "cpu") -> torch.Tensor:  # fmt: skip
    """Read output tensor ``name``'s source and apply its plan (as ``normswap.fold.fold_site`` does)."""
    tp = plans[name]
    t = reader.read(tp.source, output_dtype(reader, tp.source, dtype), device)
    for weight_name, shift, axis in tp.shift:
        source = plans[weight_name].source
        weight = reader.read(source, output_dtype(reader, source, dtype), device)
        delta = bias_delta(weight, shift, axis)
        del weight
        if delta.shape != t.shape:
            raise NormswapError(f"bias {name} has shape {tuple(t.shape)}, W b has {tuple(delta.shape)}")
        t.copy_((t.double() + delta).to(t.dtype))
    for axis, scale in tp.scales:
        scale_axis_(t, scale.to(t.device), axis)
    if tp.fill is not None:
        t.fill_(tp.fill)
    return t
