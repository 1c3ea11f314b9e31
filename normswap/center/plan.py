"""The plan: what is centered, in which feature groups, and what else changes; nothing is touched.

``plan_centering`` reads the walk's recorded forward (``normswap.recording``), finds the writers of every
LayerNorm input (``writers``), then learns which features each LayerNorm normalizes together by replaying the
recorded ops on tensors of feature indices (``ops.replay``): for the residual stream every row of a writer is
in one group; for a per-head q/k LayerNorm applied after ``view(B, S, H, head_dim)`` the groups are the
``head_dim`` rows of each head, and each head is centered separately (SliceGPT's invariance holds per
normalized group: ``LayerNorm(x) = RMSNorm(Cx) * (offset + w) + b`` with ``C`` centering that group). Then
``readers`` checks the other direction and finds the holders to untie, and ``flags`` finds config flags that
add the consumer biases a fold needs. Every refusal is raised here, before any change.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from normswap.center import ops
from normswap.center.errors import refusal
from normswap.center.flags import Flag, bias_blocked, bias_flags
from normswap.center.readers import check_readers, in_order, untie_plan
from normswap.center.writers import Write, Writers
from normswap.recording import Key
from normswap.sites import NormSite
from normswap.walk import Walk, record_forward


@dataclass
class CenterResult:
    """What ``center`` did (or, from ``plan_centering``, will do).

    Attributes:
        sites: the LayerNorm sites that become RMSNorms.
        writers: ``"param[axis]"`` of every parameter centered, with its number of groups where > 1
            (per-head centering).
        tables: embedding tables rewritten for a norm of a lookup (``"table -> norm (scale s)"``).
        untied: qualified names of the parameters given their own copy before centering.
        untie_bytes: extra bytes those copies cost.
        flags: config attributes set to True, each adding zero biases that absorb a norm's bias.
        biases_added: qualified names of the zero biases added.
        kept_bias: sites that stay RMSNorms with weight and bias (a consumer cannot take the bias).
        note: why nothing was centered, when nothing was.
        inputs: what the centered model expects as ``inputs_embeds`` and gives as hidden states
            (``center.inputs.describe``; written as ``centering.json`` beside a saved model).
    """

    sites: list[str] = field(default_factory=list)
    writers: list[str] = field(default_factory=list)
    tables: list[str] = field(default_factory=list)
    untied: list[str] = field(default_factory=list)
    untie_bytes: int = 0
    flags: list[str] = field(default_factory=list)
    biases_added: list[str] = field(default_factory=list)
    kept_bias: list[str] = field(default_factory=list)
    note: str | None = None
    inputs: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return dict(vars(self))


@dataclass
class Plan:
    """Everything ``commit.prepare`` needs; ``result`` is what the caller sees."""

    result: CenterResult
    groups: dict[tuple[str, int], list[torch.Tensor]]  # (param, axis) -> index groups centered together
    tables: dict[str, tuple[str, NormSite]]  # embedding param -> (norm site name, site)
    untie: list[tuple[str, str]]  # (module, attribute) holders that get their own copy
    flags: list[Flag]
    resolved: list[NormSite]  # sites that the flags make foldable
    tensors: dict[str, torch.Tensor]  # qualified name -> the Parameter object
    scales: dict[str, float] = field(default_factory=dict)  # rewritten table -> its norm's constant scale


def plan_centering(
    model: nn.Module,
    walk: Walk,
    inputs=None,
    *,
    untie: bool = True,
    add_biases: bool = True,
    recorded=None,
) -> Plan:
    """Plan the centering of ``model`` (arguments as ``center``); changes nothing.

    ``recorded``: a ``recording.Recorder`` of this model as it is, on inputs of the same dataflow (the walk's
    or the rotation plan's), used instead of recording another forward; None: ``walk.recording``, else one
    is recorded.

    Returns:
        A ``Plan``; its ``result.note`` says why nothing is to be done for a model without LayerNorm.

    Raises:
        CenteringError: the conversion would not be exact; the message names the site and the reason.
    """
    result = CenterResult()
    layer = [s for s in walk.sites if s.kind == "layernorm" and s.reached]  # an idle one keeps its kind
    if not layer:
        result.note = "no LayerNorm: nothing to center (centering an RMSNorm model would change it)"
        return Plan(result, {}, {}, [], [], [], {})
    rec = recorded if recorded is not None else walk.recording
    if rec is None:
        rec = record_forward(model, [s.name for s in walk.sites], inputs)
    finder = Writers(rec, {s.name: s.kind for s in walk.sites})
    cone: set[Key] = set()
    writes: dict[Key, list[Write]] = defaultdict(list)
    for site in layer:
        keys, site_writes = finder.cone(site.name)
        cone |= keys
        for w in site_writes:
            if w not in writes[w.source]:
                writes[w.source].append(w)
    index, feeds = _propagate(finder, cone, writes)
    groups, tables = _groups(finder, layer, index, feeds, writes)
    check_readers(finder, cone, index, feeds, groups, writes)
    result.sites = [s.name for s in layer]
    result.writers = [
        f"{p}[{a}]" + (f" x{len(g)} groups" if len(g) > 1 else "") for (p, a), g in groups.items()
    ]
    to_untie = untie_plan(finder, writes, untie)
    for module, attr in to_untie:
        p = model.get_submodule(module)._parameters[attr]
        result.untied.append(f"{module}.{attr}" if module else attr)
        result.untie_bytes += p.numel() * p.element_size()
    flags, resolved = bias_flags(model, layer) if add_biases else ([], [])
    result.flags = [f.name for f in flags]
    result.biases_added = [f"{m}.{a}" for f in flags for m, (a, _) in f.biases.items()]
    result.kept_bias = [s.name for s in layer if bias_blocked(s) and s not in resolved]
    for emb, (norm, _) in tables.items():
        result.tables.append(f"{emb} -> {norm}")
    return Plan(result, groups, tables, to_untie, flags, resolved, rec.tensors)


def _propagate(finder: Writers, cone: set[Key], writes: dict[Key, list[Write]]):
    """Feature-index tensors and the set of writing sources of every tensor in the cone, in op order."""
    rec = finder.rec
    index: dict[Key, torch.Tensor] = {}
    feeds: dict[Key, frozenset[Key]] = {}
    for k in in_order(rec, cone):
        node = rec.nodes.get(k)
        if k in writes:
            t = node.out if node is not None else rec.tensors[writes[k][0].param]
            axis = writes[k][0].out_axis % t.ndim
            index[k] = torch.arange(t.shape[axis], device="cpu").reshape(-1, *[1] * (t.ndim - 1 - axis))
            index[k] = index[k].expand(t.shape)  # bookkeeping tensors: on the CPU wherever the model is
            feeds[k] = frozenset([k])
        elif node.op in ops.ZEROS:
            index[k], feeds[k] = (
                torch.arange(node.out.shape[-1], device="cpu").expand(node.out.shape),
                frozenset(),
            )
        elif node.op in ops.ROWSUM:
            parts = [(index[o], feeds[o]) for o in ops.rowsum_parts(node)[0]]
            row = parts[0][0].reshape(-1, parts[0][0].shape[-1])[0]
            if any(not torch.equal(i, row.expand(i.shape)) for i, _ in parts):
                why = f"{ops.where(node)} sums rows whose features are laid out differently"
                raise refusal(finder.site_of(k), why)
            index[k], feeds[k] = row.expand(node.out.shape), frozenset().union(*(f for _, f in parts))
        elif node.op in ops.ADD:
            parts = [(index[o], feeds[o]) for o in node.operands.values() if o in index]
            first = parts[0][0].expand(node.out.shape)
            if any(not torch.equal(i.expand(node.out.shape), first) for i, _ in parts[1:]):
                why = f"{ops.where(node)} adds tensors whose features are laid out differently"
                raise refusal(finder.site_of(k), why)
            index[k], feeds[k] = first, frozenset().union(*(f for _, f in parts))
        else:
            src = finder.scaled("", node) if node.op in ops.SCALE else node.operands[0]
            index[k], feeds[k] = ops.replay(node, index[src]), feeds[src]
    return index, feeds


def _groups(finder: Writers, layer: list[NormSite], index, feeds, writes):
    """Index groups normalized together, per written (param, axis); checks that they partition the axis."""
    found: dict[tuple[str, int], set[tuple[int, ...]]] = defaultdict(set)
    reader: dict[tuple[str, int], list[str]] = defaultdict(list)
    tables: dict[str, tuple[str, NormSite]] = {}
    by_name = {s.name: s for s in layer}
    rank = {source: i for i, source in enumerate(writes)}  # the cones' order, not a set's (memory addresses)
    for site in layer:
        for k in finder.rec.norm_inputs[site.name]:
            rows = {tuple(r) for r in torch.unique(index[k].reshape(-1, index[k].shape[-1]), dim=0).tolist()}
            for source in sorted(feeds[k], key=lambda s: rank.get(s, len(rank))):
                for w in writes[source]:
                    if w.table is not None:
                        full = tuple(range(finder.rec.tensors[w.param].shape[w.axis]))
                        if rows != {full}:
                            raise refusal(site.name, f"{w.table} feeds it in a layout other than whole rows")
                        tables[w.param] = (w.table, by_name[w.table])
                        continue
                    found[(w.param, w.axis)] |= rows
                    reader[(w.param, w.axis)].append(site.name)
    groups: dict[tuple[str, int], list[torch.Tensor]] = {}
    axes: dict[str, int] = {}
    for (param, axis), rows in found.items():
        site = reader[(param, axis)][0]
        if param in tables:  # rewritten whole (``rewrite.table_rows``): may feed nothing but its norm
            if set(reader[(param, axis)]) != {tables[param][0]}:
                raise refusal(site, f"{param} is normalized by {tables[param][0]} and also written into it")
            continue
        if axes.setdefault(param, axis) != axis:
            raise refusal(site, f"{param} is written into normalized inputs along two axes")
        owner: dict[int, tuple[int, ...]] = {}
        for row in rows:
            if len(set(row)) != len(row) or any(owner.get(i, row) != row for i in row):
                raise refusal(site, f"{param} is normalized in overlapping groups of features")
            owner.update(dict.fromkeys(row, row))
        groups[(param, axis)] = [torch.tensor(sorted(r), device="cpu") for r in sorted(rows)]
    return groups, tables
