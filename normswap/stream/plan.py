"""The conversion of a streamed model as operations on checkpoint tensors, and the output shard layout.

``normswap.fold.fold_site`` (and centering, ``normswap.center``) change Parameters in memory; here the same
arithmetic is applied to each tensor as it is read from a shard, so the written tensors are bit-identical to
what the in-memory path saves:

* the transforms of the streamed model (``Streamed.transform``: centering a writer's weight, rewriting an
  embedding table), in the order they were made;
* then the fold: the records ``fold.fold_changes`` makes (a consumer bias absorbs ``W b``, a consumer
  weight is scaled along its input axis, a folded norm is set to its identity), applied by
  ``fold.apply_change``, as ``fold_site`` applies them in memory.

A parameter that transformers assembles from several checkpoint tensors (``stream.assemble``: per-expert
tensors stacked into ``experts.gate_up_proj``) is planned under its model name and made the same way, then
split back into the checkpoint's tensors by transformers' reversed converter (``make_pieces``), as
``save_pretrained`` writes it in memory: the output keeps the input's tensor names and shards.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from normswap.errors import NormswapError
from normswap.fold import FoldChange, FoldPlan, apply_change, fold_changes, scale_and_shift
from normswap.io.shards import CheckpointReader
from normswap.stream.assemble import Group
from normswap.stream.model import Streamed, StreamedParameter, is_released, read_row, read_source


@dataclass
class TensorPlan:
    """How one output tensor is made.

    Attributes:
        source: the checkpoint tensor it is read from, or None for a tensor the conversion added (a zero
            bias a config flag adds); ``value`` then holds it.
        dtype, shape: the output tensor's.
        ops: the streamed model's transforms of its values (``StreamedParameter.stream_ops``), in order.
        value: the current values of a parameter held in memory (norm scales, biases: small), used instead
            of reading ``source`` and applying ``ops`` (which gave it).
        changes: the fold's records for it (``fold.FoldChange``, names as output names), in order.
        group: a model parameter assembled from several checkpoint tensors (``source`` is its model name):
            its ``assemble.Group``; it is written as those tensors (``make_pieces``), not under its name.
        piece_of: a checkpoint tensor that is a piece of such parameters: their group.
    """

    source: str | None
    dtype: torch.dtype
    shape: tuple[int, ...]
    ops: list = field(default_factory=list)
    value: torch.Tensor | None = None
    changes: list[FoldChange] = field(default_factory=list)
    group: Group | None = None
    piece_of: Group | None = None


def output_dtype(reader: CheckpointReader, name: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype a checkpoint tensor is converted in: ``dtype`` for floating tensors, its own otherwise."""
    own = reader.tensors[name].dtype
    return dtype if own.is_floating_point else own


def output_names(streamed: Streamed) -> dict[str, torch.Tensor | None]:
    """Output tensor name -> the model's Parameter it holds (None for a checkpoint buffer), in the model's
    parameter order.

    A Parameter is written under its checkpoint name while it still holds the model name that name loads
    as; an untied copy (``lm_head.weight`` after untying) or a parameter the conversion added, under the
    name ``save_pretrained`` gives its own (``Streamed.saved_name``).
    """
    model = streamed.model
    holder = dict(model.named_parameters(remove_duplicate=False))
    names: dict[str, torch.Tensor | None] = {}
    for name, p in model.named_parameters():
        key = getattr(p, "stream_key", None)
        mine = key is not None and holder.get(streamed.loaded_as.get(key, key)) is p
        names[key if mine else streamed.saved_name(name)] = p
    for key in streamed.reader.tensors:
        if key not in names and key not in holder and key not in streamed.pieces:  # a persistent buffer
            names[key] = None
    return names


def tensor_plans(streamed: Streamed, folding: FoldPlan, dtype: torch.dtype) -> dict[str, TensorPlan]:
    """One ``TensorPlan`` per output tensor (``output_names``), with ``folding``'s sites applied.

    Args:
        streamed: the model, converted as far as fold (centered, untied: ``Streamed.transform``).
        folding: ``normswap.fold.plan`` of it.
        dtype: the dtype the model was built in (floating checkpoint tensors are converted to it).

    Raises:
        NormswapError: a plan this module does not reproduce exactly (one weight scaled along two axes
            while its bias absorbs a shift).
    """
    reader, model = streamed.reader, streamed.model
    names = output_names(streamed)
    plans: dict[str, TensorPlan] = {}
    where: dict[int, str] = {}  # id(Parameter) -> output name
    for name, p in names.items():
        if p is None:
            plans[name] = TensorPlan(name, output_dtype(reader, name, dtype), reader.tensors[name].shape)
            continue
        where[id(p)] = name
        group = getattr(p, "stream_group", None)
        if isinstance(p, StreamedParameter) and is_released(p):
            own = output_dtype(reader, group.keys[0] if group else p.stream_key, dtype)
            plans[name] = TensorPlan(p.stream_key, own, tuple(p.shape), ops=list(p.stream_ops), group=group)
        else:  # held in memory, with every transform applied
            key = getattr(p, "stream_key", None)
            plans[name] = TensorPlan(key, p.dtype, tuple(p.shape), value=p.detach(), group=group)
    for key, group in streamed.pieces.items():  # written as the pieces of their assembled parameters
        own = output_dtype(reader, key, dtype)
        plans[key] = TensorPlan(key, own, reader.tensors[key].shape, piece_of=group)

    def out(param: str) -> str:
        return where[id(model.get_parameter(param))]

    for site in folding.sites:
        scale, shift = scale_and_shift(site, model.get_submodule(site.name))
        for change in fold_changes(site, scale, shift):
            weight = out(change.weight) if change.weight is not None else None
            if change.op == "absorb" and plans[weight].changes:  # W b of the weight as it was read
                twice = f"{change.weight} is scaled twice before its bias absorbs W b"
                raise NormswapError(f"{site.name}: {twice}")
            tensor = out(change.tensor)
            plans[tensor].changes.append(replace(change, tensor=tensor, weight=weight))
    return plans


def layout(reader: CheckpointReader, plans: dict[str, TensorPlan]):
    """``{file: [(name, dtype, shape), ...]}``: the input's shard files and order. A tensor read from
    another's checkpoint tensor (an untied copy) goes right after it; one the conversion added, right after
    the last tensor of its module (else at the end of the last file)."""
    after: dict[str, list[str]] = {}
    for name, tp in plans.items():
        if name in reader.tensors or tp.group is not None:  # an assembled parameter: written as its pieces
            continue
        anchor = tp.source if tp.source in reader.tensors else None
        if anchor is None:
            module = name.rpartition(".")[0]
            anchor = next((n for n in reversed(list(reader.tensors)) if n.rpartition(".")[0] == module), None)
        after.setdefault(anchor, []).append(name)
    files = {}
    for i, file in enumerate(reader.files):
        entries = []
        names = reader.names_in(file) + (after.get(None, []) if i == len(reader.files) - 1 else [])
        for name in names:
            for n in [name, *after.get(name, [])] if name in reader.tensors else [name]:
                entries.append((n, plans[n].dtype, plans[n].shape))
        files[file] = entries
    return files


def base(reader: CheckpointReader, tp: TensorPlan, device: torch.device | str = "cpu") -> torch.Tensor:
    """A tensor's values before the fold: ``value`` copied, or ``source`` read with ``ops`` applied."""
    if tp.value is not None:
        return tp.value.to(device, copy=True)
    t = read_source(reader, tp.source, tp.group, tp.dtype, device)
    for op in tp.ops:
        t = op(t)
    return t


@torch.no_grad()
def make_tensor(reader: CheckpointReader, plans: dict[str, TensorPlan], name: str,
                device: torch.device | str = "cpu") -> torch.Tensor:  # fmt: skip
    """Output tensor ``name``: its ``base``, then the fold's changes (``fold.apply_change``, as
    ``normswap.fold.fold_site`` applies them in memory; a bias absorbs ``W b`` of its weight's ``base``).

    Raises:
        ValueError: a piece of assembled parameters (``make_pieces`` makes those); a bias whose ``W b`` does
            not have its shape.
    """
    tp = plans[name]
    if tp.piece_of is not None:
        raise ValueError(f"{name} is a piece of assembled parameters: make it with make_pieces")
    t = base(reader, tp, device)
    for change in tp.changes:
        apply_change(t, change, lambda weight: base(reader, plans[weight], device))
    return t


def make_pieces(
    reader: CheckpointReader, plans: dict[str, TensorPlan], group: Group, device: torch.device | str = "cpu"
) -> dict[str, torch.Tensor]:
    """The output tensors of ``group``'s checkpoint tensors (name -> tensor): every parameter the group
    assembles made as ``make_tensor`` makes it (read, transformed and folded as one stacked tensor, as in
    memory), then split back by transformers' reversed converter (``assemble.Group.split``: slices of it)."""
    made = {name: make_tensor(reader, plans, name, device) for name in group.targets}
    return group.split(made)


def by_rows(plans: dict[str, TensorPlan], group: Group) -> bool:
    """Whether ``group``'s output tensors can be made one row (expert) at a time with the same bytes: a
    slot-wise group (``assemble.Group.slotwise``) whose parameters are read from the checkpoint with no
    transforms, and only scaled along axes other than the rows' (a fold along the input axis: elementwise,
    ``fold.scale_axis_``), with no bias absorbed and no identity fill."""
    if not group.slotwise:
        return False
    for name in group.targets:
        tp = plans[name]
        if tp.value is not None or tp.ops:
            return False
        if any(change.op != "scale" or change.axis == 0 for change in tp.changes):
            return False
    return True


@torch.no_grad()
def make_row_pieces(
    reader: CheckpointReader,
    plans: dict[str, TensorPlan],
    group: Group,
    i: int,
    device: torch.device | str = "cpu",
) -> dict[str, torch.Tensor]:
    """The output tensors of row ``i`` of ``group`` (``by_rows``): the row of each parameter made from its
    own checkpoint tensors (``read_row``), folded as ``make_tensor`` folds the whole, split back by the
    reversed converter (``assemble.Group.split_slot``); ``make_pieces``' tensors of that row, bit for bit."""
    rows = {}
    for name in group.targets:
        tp = plans[name]
        t = read_row(reader, tp.source, group, tp.dtype, device, i).unsqueeze(0)
        for change in tp.changes:  # scales only (by_rows)
            apply_change(t, change)
        rows[name] = t
    return group.split_slot(rows, i)
