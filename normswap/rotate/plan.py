"""The plan of a residual-stream rotation: which norms read the stream, who writes it, who reads it.

Everything comes from the dataflow of one recorded forward (``normswap.recording``), never from names:

1. **stream norms**: the norms reached from an embedding lookup through sums, scalings and
   value-preserving ops (``center.ops``: ``ADD``, ``SCALE``, ``PASS``, ``ROWSUM``), and through the output
   of a norm that is added into a sum (a norm of the embedding, as BLOOM's, or a post-norm, refused below);
2. **writers**: from each stream norm's input back to the writes, by the same search centering uses
   (``center.writers.Writers``): linear maps and their biases, embedding and position tables, expert output
   projections, parameters added directly, a LayerNorm of an embedding lookup (its table). A norm whose
   output is added into the stream otherwise (Gemma 2/3, OLMo 2 post-norms) is refused here;
3. **layout**: feature indices replayed through the recorded ops (``center.plan._propagate``): every stream
   norm must see each writer's features as one row, so that ``h -> h Q`` in the stream is ``v -> v Q`` on
   that row of every writer;
4. **readers**: every tensor of the stream may be read only by the stream's own sums and views, by stream
   norms, by ``F.linear`` as its input (a reader without a norm), or returned (a hidden state); each
   stream norm's output only by linear maps (the walk's consumers); the weights of both are rotated on
   their input axis;
5. **weights**: every stream norm must end weightless (its scale folded into its consumers, or constant),
   since ``RMSNorm(h Q) = RMSNorm(h) Q`` only then; a norm whose bias no consumer can take keeps it, divided
   by its scale, and that bias is rotated.

Every refusal (``RotationError``) is raised here, before the model is touched; ``check_folding`` repeats
the weight test on the fold plan the conversion really makes (after centering), before any fold.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from dataclasses import dataclass, field

import torch
from torch import nn

from normswap.center import ops
from normswap.center.errors import CenteringError
from normswap.center.writers import Write, Writers
from normswap.errors import NormswapError
from normswap.fold import FoldPlan, Untied, scale_and_shift
from normswap.fold import plan as fold_plan
from normswap.recording import Key, Recorder
from normswap.sites import NormSite
from normswap.walk import Walk, record_forward, short_inputs

Holder = tuple[str, str]  # (module name, attribute) holding a Parameter


class RotationError(NormswapError):
    """A rotation asked of a model it cannot rotate exactly; one line naming the module and the reason.

    Raised before anything is changed (see ``plan_rotation``): the model is left as it was.
    """


@dataclass
class Target:
    """One parameter rotated along one axis.

    Attributes:
        holder: the ``(module, attribute)`` holding the Parameter when planned (resolved to the tensor it
            holds when the rotation is applied, after untying).
        axis: the parameter's axis of size ``width`` that is multiplied by the matrix.
        side: ``"output"`` (a writer into the stream), ``"input"`` (a consumer of a stream norm), or
            ``"norm bias"`` (a bias a stream norm keeps).
        index: the parameter's indices along ``axis`` that form the rotated vector, in stream order;
            None for the whole axis in order.
        site: the stream norm whose output an ``"input"`` target reads.
        module: the module whose op uses the parameter this way.
    """

    holder: Holder
    axis: int
    side: str
    index: torch.Tensor | None = None
    site: str | None = None
    module: str = ""


@dataclass
class RotationPlan:
    """What ``apply`` will rotate; from ``plan_rotation``.

    Attributes:
        width: the residual stream's width (the order of Q).
        stream_sites: names of the norms that read the stream, in execution order.
        table_sites: names of the norms of an embedding lookup whose output starts the stream (BLOOM).
        kept_bias: stream norms whose bias no consumer can take: their scale is folded, the bias stays.
        writers / readers: the parameters rotated on their output and input side.
        keep_ones: the stream is read by LayerNorms: Q must keep ``1`` (``Q 1 = 1``), so that
            ``LayerNorm(h Q) = LayerNorm(h) Q``; the conversion centers such a model first where it can.
        returned: stream norms whose output the model returns (hidden states rotated by design).
        heads: the per-head value/output rotation (``heads.HeadPlan``), or None.
        recorded: the recording forward the plan was made from (``recording.Recorder``), for centering
            to use instead of recording another (``convert`` drops it once centering has run).
    """

    width: int
    stream_sites: list[str]
    table_sites: list[str] = field(default_factory=list)
    kept_bias: list[str] = field(default_factory=list)
    writers: list[Target] = field(default_factory=list)
    readers: list[Target] = field(default_factory=list)
    keep_ones: bool = False
    returned: list[str] = field(default_factory=list)
    heads: object | None = None
    recorded: object | None = field(default=None, repr=False)


def _refuse(error: CenteringError) -> RotationError:
    site, what = getattr(error, "site", None), getattr(error, "what", None)
    if site is None:
        return RotationError(f"cannot rotate the residual stream: {error}")
    return RotationError(f"cannot rotate the residual stream read by {site}: {what}")


class StreamWriters(Writers):
    """``center.writers.Writers`` with rotation's word for a norm whose output is written into the stream.

    A LayerNorm of one embedding lookup is a table (centering rewrites it, then its rows rotate); any
    other norm output added into the stream is a post-norm, which a rotation cannot pass.
    """

    def __init__(self, rec: Recorder, sites: dict[str, NormSite]):
        super().__init__(rec, {name: s.kind for name, s in sites.items()})
        self.sites = sites

    def _table_write(self, site: str, node, k: Key) -> Write:
        other = node.site
        if self.kinds.get(other) == "layernorm":
            try:
                return super()._table_write(site, node, k)
            except CenteringError:
                pass
        norm = self.sites.get(other)
        if norm is not None and (norm.weight or norm.bias):
            raise RotationError(
                f"cannot rotate the residual stream: norm {other} adds its output, scaled by its weight, "
                "into the stream (a post-norm); that weight cannot be folded anywhere, and a rotation needs "
                "every norm on the stream weightless"
            )
        raise RotationError(
            f"cannot rotate the residual stream: norm {other} adds its output into the stream (a post-norm); "
            "rotating through a norm inside the stream is not supported"
        )


def _stream_sites(rec: Recorder) -> list[str]:
    """Norm sites reached from an embedding lookup through the ops that build a stream (module docstring)."""
    outputs: dict[str, list[Key]] = defaultdict(list)
    for k, node in rec.nodes.items():
        if node.site is not None:
            outputs[node.site].append(k)
    building = ops.ADD | ops.SCALE | ops.PASS | ops.ROWSUM
    stack = [k for k, node in rec.nodes.items() if node.op == "embedding"]
    seen: set[Key] = set()
    marked: dict[str, int] = {}
    while stack:
        k = stack.pop()
        if k in seen:
            continue
        seen.add(k)
        for use in rec.uses.get(k, []):
            if isinstance(use, tuple):
                if use[0] == "norm":
                    marked.setdefault(use[1], len(marked))
                    for out in outputs.get(use[1], []):
                        if any(not isinstance(u, tuple) and u.op in ops.ADD for u in rec.uses.get(out, [])):
                            stack.append(out)
                continue
            if use.key is not None and use.op in building:
                stack.append(use.key)
    return list(marked)


def _holder(walk_owners: list[Holder], module: str, what: str) -> Holder:
    """The holder of a parameter used in ``module``: the owner in that module, else the only owner."""
    for owner in walk_owners:
        if owner[0] == module:
            return owner
    if len(walk_owners) == 1:
        return walk_owners[0]
    raise RotationError(
        f"cannot rotate {what}: it is used in {module}, which does not hold it, and it is shared"
    )


def _qualified(holder: Holder) -> str:
    return f"{holder[0]}.{holder[1]}" if holder[0] else holder[1]


def _owners(rec: Recorder, param: str) -> list[Holder]:
    return list(rec.owners.get(param, []))


def plan_rotation(
    model: nn.Module,
    walk: Walk,
    inputs=None,
    *,
    untie: bool = True,
    heads: bool = False,
    skipped_tensors=(),
    read=None,
    recorded=None,
) -> RotationPlan:
    """Plan the rotation of ``model``'s residual stream; changes nothing.

    Args:
        model: the model, not yet converted.
        walk: ``normswap.walk.walk(model, inputs)`` of it.
        inputs: the walk's inputs (ids are cut to ``walk.SHORT_POSITIONS``: the dataflow does not depend
            on the length).
        untie: whether the fold may untie a tied consumer weight (``lm_head``).
        heads: also plan the per-head rotation of each attention's values and output projection.
        skipped_tensors: names of checkpoint tensors the loader did not load (the model never runs them):
            refused, since their inputs (the embeddings, the final hidden state) would be rotated.
        read: ``read(name)`` gives a parameter's values for the fold plan's range test
            (``normswap.fold.plan``; default ``model.get_parameter``; a streamed model reads them from disk).
        recorded: the graph of this model's forward (``recording.Recorder``: the walk's, taken with
            ``Walk.take_recording``); None: ``walk.recording``, else one is recorded.

    Returns:
        A ``RotationPlan``.

    Raises:
        RotationError: the rotation would not be exact (module docstring); the message names the module.
    """
    if skipped_tensors:
        names = sorted(skipped_tensors)
        more = f" and {len(names) - 1} more" if len(names) > 1 else ""
        raise RotationError(
            f"cannot rotate: the checkpoint holds {names[0]}{more}, which the model class does not load; "
            "they read the embeddings or the final hidden state, which the rotation changes"
        )
    sites = {s.name: s for s in walk.sites}
    rec = recorded if recorded is not None else walk.recording
    if rec is None:
        rec = record_forward(model, [s.name for s in walk.sites], short_inputs(inputs))
    finder = StreamWriters(rec, sites)
    marked = _stream_sites(rec)
    if not marked:
        raise RotationError(
            "cannot rotate: no norm reads a residual stream that starts at an embedding lookup (through "
            "sums, scalings and views)"
        )
    cone: set[Key] = set()
    writes: dict[Key, list[Write]] = defaultdict(list)
    try:
        for name in marked:
            keys, site_writes = finder.cone(name)
            cone |= keys
            for w in site_writes:
                if w not in writes[w.source]:
                    writes[w.source].append(w)
        from normswap.center.plan import _propagate  # the layout replay centering uses

        index, feeds = _propagate(finder, cone, writes)
    except CenteringError as error:
        raise _refuse(error) from error
    tables = sorted({w.table for ws in writes.values() for w in ws if w.table is not None})
    stream = [s.name for s in walk.sites if s.name in marked and s.name not in tables]
    width = _width(rec, stream, sites)
    plan = RotationPlan(width=width, stream_sites=stream, table_sites=tables)
    plan.keep_ones = any(sites[n].kind == "layernorm" for n in stream + tables)
    rows = _rows(finder, stream + tables, index, feeds, writes, width)
    _check_readers(finder, cone, set(stream) | set(tables), plan)
    for ws in writes.values():
        for w in ws:
            if w.table is not None:  # the table's own lookup (the table norm's input) is its write
                continue
            holder = _holder(_owners(rec, w.param), w.user.module, w.param)
            size = rec.tensors[w.param].shape[w.axis]
            group = rows[(w.param, w.axis)]
            whole = torch.arange(width, device=group.device)
            idx = None if size == width and torch.equal(group, whole) else group
            target = Target(holder, w.axis, "output", idx, module=w.user.module)
            if not any(t.holder == holder and t.axis == w.axis for t in plan.writers):
                plan.writers.append(target)
    for name in stream:
        plan.readers.extend(_readers(walk, sites[name], width))
        if "is returned as a model output" in walk.other_uses.get(name, []):
            plan.returned.append(name)
    _check_uses(walk, plan)
    _check_untouched(model, walk, width, plan)
    _precheck_weights(model, walk, plan, untie, read)
    if heads:
        from normswap.rotate.heads import plan_heads

        plan.heads = plan_heads(model, rec, plan)
    plan.recorded = rec
    return plan


def _width(rec: Recorder, stream: list[str], sites: dict[str, NormSite]) -> int:
    inputs = [k for n in stream for k in rec.norm_inputs[n]]
    widths = {rec.nodes[k].out.shape[-1] if k in rec.nodes else None for k in inputs}
    widths |= {sites[n].shape[-1] for n in stream}
    if len(widths) != 1 or None in widths:
        raise RotationError(
            f"cannot rotate: the stream norms read features of different widths {sorted(widths, key=str)}"
        )
    return widths.pop()


def _rows(finder, names, index, feeds, writes, width) -> dict[tuple[str, int], torch.Tensor]:
    """For each written ``(param, axis)``, its indices in stream order (one row, the same at every norm)."""
    rows: dict[tuple[str, int], torch.Tensor] = {}
    for name in names:
        for k in finder.rec.norm_inputs[name]:
            seen = torch.unique(index[k].reshape(-1, index[k].shape[-1]), dim=0)
            if seen.shape != (1, width):
                raise RotationError(
                    f"cannot rotate the residual stream read by {name}: its features are not one row of "
                    "each writer (a writer's features reach it reordered or in pieces)"
                )
            for source in feeds[k]:
                for w in writes[source]:
                    key = (w.param, w.axis)
                    if key in rows and not torch.equal(rows[key], seen[0]):
                        raise RotationError(
                            f"cannot rotate: {w.param} reaches the stream norms in two feature orders"
                        )
                    rows[key] = seen[0]
    return rows


def _check_readers(finder: Writers, cone: set[Key], norms: set[str], plan: RotationPlan) -> None:
    """Every tensor of the stream is read by the stream's own ops, by stream norms, by ``F.linear`` as its
    input (a reader without a norm: its weight rotates on the input axis, ``plan.readers``), or returned."""
    from normswap.center.readers import in_order

    rec = finder.rec
    for k in in_order(rec, cone):
        for use in rec.uses.get(k, []):
            if not isinstance(use, tuple) and use.op == "linear" and use.operands.get(0) == k:
                plan.readers.append(_direct_reader(finder, use))
                continue
            if isinstance(use, tuple):
                kind, site = use
                if kind == "norm" and site in norms:
                    continue
                if kind == "output":
                    continue  # a hidden state returned: rotated by design (reported)
                raise RotationError(
                    f"cannot rotate: the residual stream is also read by norm {site}, which is not one of "
                    "its norms (a rotation would change what it sees)"
                )
            if use.key in cone:
                continue
            where = ops.where(use)
            if use.op in ops.LINEAR:
                raise RotationError(
                    f"cannot rotate: the residual stream is read directly (not through a norm) by {where}, "
                    "not as the input of F.linear"
                )
            raise RotationError(
                f"cannot rotate: the residual stream is read by {where}, which is not a linear map of it "
                "(a non-linear reader of the stream)"
            )


def _direct_reader(finder: Writers, node) -> Target:
    """The input-side target of ``F.linear(stream, W)`` (no norm between: ``x W^T = (x Q)(W Q)^T``)."""
    wkey = node.operands.get(1, node.operands.get("weight"))
    ref = finder.param_ref(wkey) if wkey is not None else None
    if ref is None or ref.dims[-1] is None:
        raise RotationError(
            f"cannot rotate: the residual stream is read directly by {ops.where(node)}, whose weight is not "
            "a parameter"
        )
    holder = _holder(_owners(finder.rec, ref.param), node.module, ref.param)
    return Target(holder, ref.dims[-1], "input", module=node.module)


def _readers(walk: Walk, site: NormSite, width: int) -> list[Target]:
    """The input-side targets of one stream norm: its consumers, each weight once."""
    if not site.reached or not site.swappable:
        raise RotationError(f"cannot rotate: stream norm {site.name} is {site.reason}")
    others = [u for u in walk.other_uses.get(site.name, []) if u != "is returned as a model output"]
    if others:
        raise RotationError(
            f"cannot rotate: the output of stream norm {site.name} {others[0]} (a reader of the stream that "
            "is not a linear map)"
        )
    if len(site.shape) != 1 or site.shape[0] != width:
        raise RotationError(
            f"cannot rotate: stream norm {site.name} has a scale of shape {tuple(site.shape)}"
        )
    targets: list[Target] = []
    for c in site.consumers:
        holder = _holder(walk.owners.get(c.param, []), c.module, c.param)
        if not any(t.holder == holder and t.axis == c.axis for t in targets):
            targets.append(Target(holder, c.axis, "input", site=site.name, module=c.module))
    return targets


def _check_uses(walk: Walk, plan: RotationPlan) -> None:
    """A rotated parameter may be used by nothing but the ops it is rotated for (its holders' modules)."""
    name_of = {holder: name for name, holders in walk.owners.items() for holder in holders}
    modules: dict[str, set[str]] = defaultdict(set)
    for t in plan.writers + plan.readers:
        modules[name_of.get(t.holder, _qualified(t.holder))] |= {t.module, t.holder[0]}
    for name, allowed in modules.items():
        for op, module in walk.param_uses.get(name, []):
            if module not in allowed:
                raise RotationError(f"cannot rotate: {name} is rotated and also used by {op} in {module}")


def _check_untouched(model: nn.Module, walk: Walk, width: int, plan: RotationPlan) -> None:
    """A weight no op used in the trace, as wide as the stream and inside a module that holds a rotated
    weight (an expert that got no token, next to those that did), may read or write the stream on other
    inputs: refused. One that shares no module with a rotated weight (a leftover top-level table) never
    runs in the forward and is left as it is."""
    from normswap.walk import _common_depth

    modules = [t.holder[0] for t in plan.writers + plan.readers]
    for name in walk.untouched:
        if width not in model.get_parameter(name).shape:
            continue
        near = max((m for m in modules), key=lambda m: _common_depth(name, m), default=None)
        if near is not None and _common_depth(name, near) >= 1:
            raise RotationError(
                f"cannot rotate: {name} was never used in the trace, and it may read or write the residual "
                f"stream on other inputs (it sits beside {near}, which is rotated)"
            )


def _constant_scale(site: NormSite, module: nn.Module) -> bool:
    """Whether the norm's ``offset + w`` is one value and its bias absent or zero (it commutes with Q)."""
    scale, shift = scale_and_shift(site, module)
    constant = bool((scale == scale.reshape(-1)[0]).all())
    return constant and (shift is None or not bool(shift.any()))


def kept_bias_blocked(site: NormSite, walk: Walk) -> bool:
    """Whether ``site`` is unfoldable only because a consumer has no bias for its bias (centering keeps the
    bias on the norm then): every use a consumer, one scale per feature, a bias, some consumer without."""
    return (
        site.bias is not None
        and site.reached
        and site.swappable
        and not walk.other_uses.get(site.name)
        and bool(site.consumers)
        and len(site.shape) == 1
        and any(c.bias is None for c in site.consumers)
    )


def _precheck_weights(model: nn.Module, walk: Walk, plan: RotationPlan, untie: bool, read=None) -> None:
    """Every stream norm will end weightless: refused now when it cannot (before any change)."""
    trial = copy.deepcopy(walk)  # fold.plan records on its walk's sites: a copy (the real plan is later)
    folds = {s.name for s in fold_plan(model, trial, untie=untie, read=read).sites}
    by_name = {s.name: s for s in trial.sites}
    for name in plan.stream_sites:
        site, module = by_name[name], model.get_submodule(name)
        if name in folds or _constant_scale(site, module):
            continue
        if kept_bias_blocked(site, walk):
            _check_scale_invertible(site, module)
            plan.kept_bias.append(name)
            continue
        raise RotationError(
            f"cannot rotate: stream norm {name} keeps its weight ({site.reason}); a rotation needs every "
            "norm on the residual stream weightless"
        )


def _check_scale_invertible(site: NormSite, module: nn.Module) -> None:
    scale, _ = scale_and_shift(site, module)
    if not bool((scale != 0).all()) or not bool(torch.isfinite(scale).all()):
        raise RotationError(
            f"cannot rotate: stream norm {site.name} keeps its bias and has a zero or non-finite scale, so "
            "the bias cannot be moved before the scale"
        )


def check_folding(
    model: nn.Module, walk: Walk, plan: RotationPlan, folding: FoldPlan, untied: Untied
) -> None:
    """The weight test on the conversion's real fold plan (after centering and untying), before any fold.

    A stream norm must be folded, weightless (constant scale, no bias), or keep only its bias (``kept_bias``,
    whose consumer weights must then be its own); a table norm must hold a constant scale. On a refusal the
    untying is undone (``untied.restore()``).

    Raises:
        RotationError: naming the norm and why.
    """
    folds = {s.name for s in folding.sites}
    by_name = {s.name: s for s in walk.sites}
    try:
        for name in plan.stream_sites:
            site, module = by_name[name], model.get_submodule(name)
            if name in folds or _constant_scale(site, module):
                if name in plan.kept_bias:
                    plan.kept_bias.remove(name)  # centering's flags gave its consumers biases
                continue
            if name in plan.kept_bias and kept_bias_blocked(site, walk):
                _check_own_consumers(site, walk)
                continue
            raise RotationError(
                f"cannot rotate: stream norm {name} keeps its weight ({site.reason}); a rotation needs every "
                "norm on the residual stream weightless"
            )
        for name in plan.table_sites:
            if not _constant_scale(by_name[name], model.get_submodule(name)):
                raise RotationError(f"cannot rotate: norm {name} of an embedding lookup keeps a weight")
    except RotationError:
        untied.restore()
        raise


def _check_own_consumers(site: NormSite, walk: Walk) -> None:
    """The consumer weights of a kept-bias norm are used by its consumers only (its scale folds into them)."""
    modules = {c.module for c in site.consumers}
    for c in site.consumers:
        uses = walk.param_uses.get(c.param, [])
        owners = walk.owners.get(c.param, [])
        if len(owners) > 1 or any(m not in modules for _, m in uses):
            raise RotationError(
                f"cannot rotate: stream norm {site.name} keeps its bias, and its consumer weight {c.param} "
                "is shared, so its scale cannot be folded into it"
            )
