"""Model parameters that transformers assembles from several checkpoint tensors, and their split back.

transformers 5 loads some checkpoints through its weight-conversion mapping
(``transformers.conversion_mapping.get_model_conversion_mapping``): a ``WeightRenaming`` renames a tensor, a
``WeightConverter`` makes model parameters from several checkpoint tensors with a list of operations (the
per-expert ``gate_proj``/``up_proj`` of Qwen3-MoE, Mixtral's ``w1``/``w3``, stacked by ``MergeModulelist``
and concatenated by ``Concatenate`` into one ``experts.gate_up_proj``), and ``save_pretrained`` writes them
back with the reversed transforms (``reverse_transform``: ``Chunk``, ``SplitModulelist``).

A ``Group`` is one such conversion as transformers' loader forms it (``convert_and_load_state_dict_in_model``:
the checkpoint tensors a converter collects under one target name, in its order, ``dot_natural_key``). Its
``assemble`` runs the converter itself (``WeightConverter.convert``) on the tensors read from the shards;
its ``split`` runs the reversed converter as ``revert_weight_conversion`` does, then the reversed renamings,
giving back the checkpoint's tensors under their own names. Both are checked on the meta device when the
group is made (``groups``): the assembled parameters have the model's names and shapes, and the split gives
exactly the checkpoint tensors the group read, with their shapes, so the output can keep the input's layout.
No table of ours: the patterns and operations are transformers'.

A group is *slot-wise* when its parameters' rows along their first axis (one expert each) can be made one at
a time: row ``i`` of every parameter is what the converter makes from the ``i``-th checkpoint tensor of each
of its source patterns (``assemble_slot``), and the reversed converter splits that row back into those
tensors (``split_slot``). This is established from behaviour when the group is made (``_check_slots``): on the
meta device with the real shapes, and on small tensors of distinct values (every axis cut to at most 12
entries) whose rows, assembled one at a time, must equal the whole assembly's, and split back, the tensors
themselves. A slot-wise parameter is then read one expert at a time (``stream.model``: an expert's weights as
the eager experts forward indexes them; the fold plan's overflow test and the write, row by row), so no
step holds a whole stack of experts.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from normswap.errors import NormswapError


@dataclass
class Group:
    """One conversion of transformers' loader: model parameters made from several checkpoint tensors.

    Attributes:
        first: the name transformers keys the conversion by (its first target parameter).
        converter: the mapping's ``WeightConverter`` (a copy, nothing collected).
        sources: ``(source pattern, checkpoint tensor name)`` in the order the loader collects them.
        targets: model parameter name -> shape, as the converter makes them.
        reverse: the reversed converter (``reverse_transform``) that ``save_pretrained`` applies.
        reverse_first: the name the reversed conversion is keyed by; ``reverse_patterns``: model parameter
            name -> the reversed converter's source pattern it matches.
        renamings: the reversed renamings ``save_pretrained`` applies to the split tensors' names.
        model: the model (some operations read its parameters' shapes or its config).
    """

    first: str
    converter: object
    sources: list[tuple[str, str]]
    targets: dict[str, tuple[int, ...]] = field(default_factory=dict)
    reverse: object = None
    reverse_first: str = ""
    reverse_patterns: dict[str, str] = field(default_factory=dict)
    renamings: list = field(default_factory=list)
    model: torch.nn.Module | None = None
    slots: int = 0

    @property
    def slotwise(self) -> bool:
        """Whether its parameters can be made (and split back) one row of the first axis at a time."""
        return self.slots > 0

    def slot_sources(self, i: int) -> list[tuple[str, str]]:
        """The ``(pattern, key)`` sources of row ``i``: the ``i``-th tensor of each source pattern, in the
        loader's order."""
        from transformers.core_model_loading import dot_natural_key

        by_pattern: dict[str, list[str]] = {}
        for pattern, key in self.sources:
            by_pattern.setdefault(pattern, []).append(key)
        picked = [(pattern, keys[i]) for pattern, keys in by_pattern.items()]
        return sorted(picked, key=lambda pk: dot_natural_key(pk[1]))

    def slot_of(self, key: str) -> int:
        """The row that checkpoint tensor ``key`` belongs to."""
        return next(i for i in range(self.slots) if any(k == key for _, k in self.slot_sources(i)))

    def assemble_slot(self, read: Callable[[str], torch.Tensor], i: int) -> dict[str, torch.Tensor]:
        """Model parameter name -> its row ``i`` (shape ``(1, *rest)``), from the tensors of that row only."""
        return self._convert(self.first, self.slot_sources(i), read)

    def split_slot(self, rows: dict[str, torch.Tensor], i: int) -> dict[str, torch.Tensor]:
        """Checkpoint tensor name -> tensor: row ``i`` of every parameter (``(1, *rest)`` each) split back
        (``split`` on one row names row 0's tensors; they are row ``i``'s, in the same order)."""
        out = self.split(rows)
        names = dict(
            zip([k for _, k in self.slot_sources(0)], [k for _, k in self.slot_sources(i)], strict=True)
        )
        return {names[name]: t for name, t in out.items()}

    def _convert(self, first, sources, read):
        converter = copy.deepcopy(self.converter)
        for pattern, key in sources:
            converter.add_tensor(first, key, pattern, functools.partial(read, key))
        out = converter.convert(first, model=self.model, config=self.model.config)
        return {name: t[0] if isinstance(t, list) else t for name, t in out.items()}

    @property
    def keys(self) -> list[str]:
        """The checkpoint tensors it reads, in the loader's order."""
        return [key for _, key in self.sources]

    def assemble(self, read: Callable[[str], torch.Tensor]) -> dict[str, torch.Tensor]:
        """Model parameter name -> tensor: ``read(key)`` for every source tensor, then the converter's
        operations (``WeightConverter.convert``, as transformers loads them).

        Args:
            read: checkpoint tensor name -> tensor (in the dtype and on the device wanted: the operations
                only stack, concatenate and slice, so casting before or after gives the same values).
        """
        return self._convert(self.first, self.sources, read)

    def split(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Checkpoint tensor name -> tensor: the model parameters ``tensors`` (name -> values, every target)
        split back by the reversed converter and renamed as ``save_pretrained`` (``revert_weight_conversion``)
        does."""
        from transformers.core_model_loading import apply_renamings, dot_natural_key

        reverse = copy.deepcopy(self.reverse)
        for name in sorted(tensors, key=dot_natural_key):
            reverse.add_tensor(self.reverse_first, name, self.reverse_patterns[name], tensors[name])
        out = reverse.convert(self.reverse_first, model=self.model, config=self.model.config)
        out = {name: t[0] if isinstance(t, list) else t for name, t in out.items()}
        return {apply_renamings(name, self.renamings): t for name, t in out.items()}


def _meta(shape, dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


def groups(
    model: torch.nn.Module,
    tensors: dict,
    conversions: list,
    converted: dict[str, tuple[str, str]],
    source: str,
) -> list[Group]:
    """The groups of the checkpoint tensors that transformers' converters take.

    Args:
        model: the model (built on the meta device).
        tensors: checkpoint tensor name -> ``shards.TensorInfo`` (dtype, shape).
        conversions: the model's weight-conversion mapping, after every checkpoint name was matched
            against it (so ``was_used`` tells which ``save_pretrained`` reverses).
        converted: checkpoint tensor name -> ``(target name, source pattern)`` for the tensors a converter
            matched (``transformers.core_model_loading.rename_source_key``).
        source: the checkpoint, for messages.

    Raises:
        NormswapError: the converter does not make parameters of the model's names and shapes from these
            tensors (a missing expert, another layout), or ``save_pretrained``'s reverse would not give back
            exactly these tensors: the checkpoint cannot be streamed in its own layout (one line).
    """
    from transformers.core_model_loading import (
        WeightConverter,
        WeightRenaming,
        apply_converters,
        dot_natural_key,
    )

    by_pattern = {p: c for c in conversions if isinstance(c, WeightConverter) for p in c.source_patterns}
    used = [c for c in conversions if c.was_used()][::-1]  # as revert_weight_conversion reverses them
    reversed_ = [c.reverse_transform() for c in used]
    reverse_renamings = [c for c in reversed_ if isinstance(c, WeightRenaming)]
    reverse_converters = [c for c in reversed_ if isinstance(c, WeightConverter)]
    reverse_by_pattern = {p: c for c in reverse_converters for p in c.source_patterns}
    made: dict[str, Group] = {}
    for key in sorted(converted, key=dot_natural_key):
        first, pattern = converted[key]
        if first not in made:
            made[first] = Group(first, copy.deepcopy(by_pattern[pattern]), [], model=model)
        made[first].sources.append((pattern, key))
    params = dict(model.named_parameters())
    for group in made.values():
        what = f"{source}: transformers assembles {len(group.sources)} tensors ({group.keys[0]}, ...) into "
        try:
            got = group.assemble(lambda key: _meta(tensors[key].shape, tensors[key].dtype))
        except Exception as error:  # noqa: BLE001 - an operation's own error (torch.cat of unequal shapes)
            first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise NormswapError(
                f"{what}{group.first}, which fails ({first}): the checkpoint's tensors do not fit the model "
                "(a missing or extra tensor?)"
            ) from error
        for name, t in got.items():
            if name not in params or tuple(params[name].shape) != tuple(t.shape):
                expected = f"the model's is {tuple(params[name].shape)}" if name in params else (
                    "the model has no such parameter")  # fmt: skip
                raise NormswapError(
                    f"{what}{name} of shape {tuple(t.shape)}, but {expected}: the checkpoint's tensors do "
                    "not fit the model (a missing or extra tensor?)"
                )
            group.targets[name] = tuple(t.shape)
        first_reverse = None
        for name in group.targets:
            renamed, pattern = apply_converters(name, reverse_converters)
            if pattern is None or (first_reverse is not None and renamed != first_reverse):
                raise NormswapError(
                    f"{source}: transformers cannot write {name} back as the checkpoint's {group.keys[0]}, "
                    "...: it cannot be streamed in its own layout"
                )
            first_reverse = renamed
            group.reverse_patterns[name] = pattern
        group.reverse = copy.deepcopy(reverse_by_pattern[group.reverse_patterns[next(iter(group.targets))]])
        group.reverse_first, group.renamings = first_reverse, reverse_renamings
        back = group.split({name: _meta(shape, params[name].dtype) for name, shape in group.targets.items()})
        want = {key: tuple(tensors[key].shape) for key in group.keys}
        have = {key: tuple(t.shape) for key, t in back.items()}
        if have != want:
            odd = sorted(set(have) ^ set(want)) or sorted(k for k in want if have[k] != want[k])
            raise NormswapError(
                f"{source}: transformers' save would write {group.first} back as other tensors than the "
                f"checkpoint's ({odd[0]} differs): it cannot be streamed in its own layout"
            )
        group.slots = _check_slots(group, tensors)
    return list(made.values())


_PROBE = 12  # the longest axis of a slot probe's tensors (divisible by 2, 3, 4 and 6: chunks still split)


def _check_slots(group: Group, tensors: dict) -> int:
    """The number of rows when ``group`` is slot-wise (see the module docstring), else 0: every source
    pattern has one tensor per row of every parameter, a row made from its own tensors has the parameter's
    row shape (meta, real shapes), and on small tensors of distinct values the rows made one at a time equal
    the whole assembly's and split back into exactly their tensors."""
    patterns: dict[str, int] = {}
    for pattern, _ in group.sources:
        patterns[pattern] = patterns.get(pattern, 0) + 1
    rows = {shape[0] if shape else 0 for shape in group.targets.values()}
    if len(rows) != 1 or set(patterns.values()) != rows or min(rows) < 2:
        return 0
    n = rows.pop()
    try:
        meta = group.assemble_slot(lambda key: _meta(tensors[key].shape, tensors[key].dtype), 0)
        if {k: tuple(t.shape) for k, t in meta.items()} != {
            k: (1, *shape[1:]) for k, shape in group.targets.items()
        }:
            return 0
        probes, start = {}, 0
        for key in group.keys:
            shape = [min(d, _PROBE) for d in tensors[key].shape]
            numel = 1
            for d in shape:
                numel *= d
            probes[key] = torch.arange(start, start + numel, dtype=torch.float64).reshape(shape)
            start += numel
        whole = group.assemble(probes.__getitem__)
        back: dict[str, torch.Tensor] = {}
        for i in range(n):
            row = group.assemble_slot(probes.__getitem__, i)
            if set(row) != set(whole) or not all(torch.equal(row[k], whole[k][i : i + 1]) for k in row):
                return 0
            back.update(group.split_slot(row, i))
    except Exception:  # noqa: BLE001 - an operation that needs the real shapes: assembled whole
        return 0
    if set(back) != set(probes) or not all(torch.equal(back[k], probes[k]) for k in probes):
        return 0
    return n
