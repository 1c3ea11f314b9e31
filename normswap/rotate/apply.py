"""Applying a rotation: every tensor's new values computed in float64 from its current values, rounded once.

For a row ``h`` of the residual stream (features last), the rotated model computes ``h Q`` wherever the
original computed ``h``:

* a writer ``y = x Wᵀ + c`` into the stream (a linear map, an embedding or position table, an expert's output
  projection, a bias added directly) writes ``y Q``: each row of ``W`` along its output axis, and ``c``,
  becomes ``v -> v Q``;
* a stream norm is weightless (its scale ``g = offset + w`` and bias ``b`` folded), so
  ``RMSNorm(h Q) = RMSNorm(h) Q`` (Q is orthogonal: it keeps the norm of ``h``);
* a consumer ``z = (n ∘ g + b) Wᵀ + c`` of that norm reads ``n Q``: ``W <- W diag(g) Q`` along its input axis
  and ``c <- c + W b`` (``normswap.fold``'s fold, done here in the same float64 pass as the rotation, so
  the weight is rounded once); a norm whose bias no consumer can take keeps ``(b / g) Q``;
* per-head (``--rotate-heads``): a value projection's rows of each head ``v -> v H`` and the output
  projection's input columns of each head likewise, which attention passes through unchanged
  (``attn(q, k, v H) = attn(q, k, v) H`` per head).

Every operation of one tensor is one ``TensorRotation`` (the record the report and the saved manifest show,
and the one a streamed conversion applies tensor by tensor): ``scale`` (a fold, first) then ``rotations``,
computed by ``transform`` in float64 blocks of ``CHUNK`` elements, rounded once into the tensor's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from normswap.fold import absorbed, fold_changes, scale_and_shift, tensor_of
from normswap.rotate.matrix import Matrix
from normswap.rotate.plan import RotationPlan, Target
from normswap.sites import NormSite

CHUNK = 1 << 22  # float64 elements per block of arithmetic (32 MiB)


@dataclass
class TensorRotation:
    """What happens to one tensor (the rotation record's unit: which matrix, applied where, on which side).

    Attributes:
        name: the parameter's name (its state-dict key).
        sides: ``"output"`` (writes into the stream), ``"input"`` (reads a stream norm), ``"norm bias"``,
            ``"head output"`` / ``"head input"`` (per-head values and output projection), one per rotation.
        scale: ``(axis, site)``: the stream norm ``site``'s scale folded in along ``axis`` first, or None.
        divide: the site whose scale divides this tensor first (a kept norm bias ``b / g``), or None.
        shift: the site whose bias this consumer bias absorbs first (``c + W b``, the fold), or None.
        rotations: ``(axis, matrix name, index)``: the vectors along ``axis`` (at ``index``, a list of
            index groups in stream or head order, or None for the whole axis) are multiplied by the matrix.
    """

    name: str
    sides: list[str] = field(default_factory=list)
    scale: tuple[int, str] | None = None
    divide: str | None = None
    shift: str | None = None
    rotations: list[tuple[int, str, list[torch.Tensor] | None]] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "sides": list(self.sides),
            "fold": None if self.scale is None else {"axis": self.scale[0], "norm": self.scale[1]},
            "divide_by_scale_of": self.divide,
            "absorbs_bias_of": self.shift,
            "rotations": [
                {"axis": a, "matrix": m, "index": "all" if g is None else [_indices(x) for x in g]}
                for a, m, g in self.rotations
            ],
        }


def _indices(index: torch.Tensor) -> str | list[int]:
    """``"start:stop"`` for consecutive indices (a head's rows), else the list."""
    values = index.tolist()
    if values and values == list(range(values[0], values[0] + len(values))):
        return f"{values[0]}:{values[0] + len(values)}"
    return values


def _blocks(shape: tuple[int, ...], axes: set[int]):
    """Slices ``(dim, start, length)`` along a dim not in ``axes`` of at most ~``CHUNK`` elements, or one
    ``(None, 0, 0)`` when every dim is used (the whole tensor at once)."""
    free = [d for d in range(len(shape)) if d not in axes and shape[d] > 1]
    if not free:
        yield None, 0, 0
        return
    dim = max(free, key=lambda d: shape[d])
    numel = 1
    for s in shape:
        numel *= s
    step = max(1, CHUNK // max(1, numel // shape[dim]))
    for start in range(0, shape[dim], step):
        yield dim, start, min(step, shape[dim] - start)


def rotate_along(x: torch.Tensor, axis: int, m: torch.Tensor, groups: list[torch.Tensor] | None):
    """``x`` with its vectors along ``axis`` (each index group, in order; ``None``: all) multiplied by ``m``
    (differentiable: ``rotate.learn``'s proxy trains through it)."""
    y = x.movedim(axis, -1)
    if groups is None:
        return (y @ m).movedim(-1, axis)
    y = y.clone()
    for g in groups:
        g = g.to(y.device)
        y[..., g] = y[..., g] @ m
    return y.movedim(-1, axis)


@torch.no_grad()
def transform(
    t: torch.Tensor,
    matrices: dict[str, torch.Tensor],
    scale: tuple[int, torch.Tensor] | None = None,
    divide: torch.Tensor | None = None,
    rotations=(),
    add: torch.Tensor | None = None,
) -> torch.Tensor:
    """The new values of ``t``: ``t``'s float64 values plus ``add`` (float64, ``t``'s shape), divided by
    ``divide`` (last axis), scaled by ``scale = (axis, vector)``, then multiplied by each
    ``(axis, matrix name, groups)`` of ``rotations``, rounded once into ``t.dtype``.

    Args:
        t: a parameter (any float dtype, any device); not changed.
        matrices: matrix name -> float64 ``(n, n)`` on ``t.device``.

    Returns:
        A new tensor of ``t``'s shape, dtype and device. The float64 arithmetic runs in blocks of at most
        ``CHUNK`` elements along an axis no operation uses. The blocks depend on ``t``'s shape alone, so the
        same tensor gives the same bytes in memory and streamed; the elementwise steps give the same bytes
        for any block, but a rotation's float64 product may not (a BLAS picks its kernel by the number of
        rows: measured, rows of 1 or 7 differ in the last bits from the same rows in a block of 2400).
    """
    out = torch.empty_like(t)
    axes = {a % t.ndim for a, _, _ in rotations}
    if scale is not None:
        axes.add(scale[0] % t.ndim)
    if divide is not None or add is not None:
        axes |= set(range(t.ndim))  # a norm or consumer bias: one vector, one block
    for dim, start, length in _blocks(tuple(t.shape), axes):
        src = t if dim is None else t.narrow(dim, start, length)
        x = src.detach().double()
        if add is not None:
            x = x + add.to(x.device)
        if divide is not None:
            x = x / divide.to(x.device)
        if scale is not None:
            shape = [1] * t.ndim
            shape[scale[0] % t.ndim] = -1
            x = x * scale[1].to(x.device).reshape(shape)
        for axis, name, groups in rotations:
            x = rotate_along(x, axis % t.ndim, matrices[name].to(x.device), groups)
        (out if dim is None else out.narrow(dim, start, length)).copy_(x.to(t.dtype))
    return out


def _names(model: nn.Module) -> dict[int, str]:
    names: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), name)
    return names


def _tensor(model: nn.Module, holder: tuple[str, str]) -> nn.Parameter:
    return model.get_submodule(holder[0])._parameters[holder[1]]


@dataclass
class Change:
    """One tensor's change: the tensor, its record, and the float64 operands ``transform`` takes.

    Attributes:
        tensor: the Parameter (in memory, or a streamed one whose values are on disk).
        record: its ``TensorRotation``.
        scale: ``(axis, float64 scale)`` of the stream norm folded into it, or None.
        divide: the float64 scale a kept norm bias is divided by, or None.
        add: the float64 ``W b`` a consumer bias absorbs (computed from the weight before any change), or
            None.
    """

    tensor: torch.Tensor
    record: TensorRotation
    scale: tuple[int, torch.Tensor] | None = None
    divide: torch.Tensor | None = None
    add: torch.Tensor | None = None

    def op(self, matrices: dict[str, torch.Tensor]):
        """``t -> new values of t`` (``transform`` with this change's operands, ``matrices`` on the CPU
        or any device), refusing a value the dtype cannot hold (``RotationError``)."""

        def run(t: torch.Tensor) -> torch.Tensor:
            value = transform(t, matrices, self.scale, self.divide, self.record.rotations, self.add)
            if t.is_floating_point() and bool((~torch.isfinite(value) & torch.isfinite(t)).any()):
                from normswap.rotate.plan import RotationError

                limit = torch.finfo(t.dtype).max
                raise RotationError(
                    f"cannot rotate: {self.record.name} would leave the range of {t.dtype} ({limit:.6g})"
                )
            return value

        return run


@dataclass
class Changes:
    """Every change a rotation makes, in order (``plan_changes``): ``changes`` (one per tensor), ``fills``
    (``(norm parameter, identity value)`` of the folded stream norms) and ``folded`` (their names)."""

    changes: list[Change] = field(default_factory=list)
    fills: list[tuple[torch.Tensor, float]] = field(default_factory=list)
    folded: list[str] = field(default_factory=list)

    @property
    def records(self) -> list[TensorRotation]:
        return [c.record for c in self.changes]


@torch.no_grad()
def plan_changes(
    model: nn.Module,
    plan: RotationPlan,
    sites: list[NormSite],
    folded: set[str],
    read=None,
) -> Changes:
    """Which tensor gets which fold and matrix, on which axis and side; changes nothing.

    The in-memory conversion (``apply``) and the streamed one (``normswap.stream.store.ShardStore``) both
    take their changes from here, so both compute the same float64 arithmetic in the same order.

    Args:
        model, plan, sites, folded: as ``apply``'s.
        read: ``read(tensor)`` gives a weight's current values where the whole is needed now (``W b`` of a
            consumer bias; default: the tensor itself; ``normswap.stream`` reads it from its shard).

    Raises:
        ValueError: a consumer bias does not have the shape ``W b`` gives.
    """
    read = read or (lambda t: t)
    names = _names(model)
    by_site = {s.name: s for s in sites}
    changes: dict[int, Change] = {}
    result = Changes()

    def entry(p: torch.Tensor) -> Change:
        if id(p) not in changes:
            changes[id(p)] = Change(p, TensorRotation(names.get(id(p), "?")))
        return changes[id(p)]

    for name in plan.stream_sites:
        site = by_site[name]
        norm = model.get_submodule(name)
        if name not in folded and name not in plan.kept_bias:
            continue
        scale, shift = scale_and_shift(site, norm)
        # the fold's records (fold.fold_changes), computed here in the rotation's float64 pass
        for fold in fold_changes(site, scale, shift if name in folded else None):
            if fold.op == "scale":
                change = entry(model.get_parameter(fold.tensor))
                change.record.scale, change.scale = (fold.axis, name), (fold.axis, fold.operand)
            elif fold.op == "absorb":
                entry(model.get_parameter(fold.weight))  # the weight's record first
                bias = model.get_parameter(fold.tensor)
                delta = absorbed(fold, bias.shape, lambda weight: read(model.get_parameter(weight)))
                entry(bias).record.shift = name
                changes[id(bias)].add = delta
            elif fold.tensor != f"{name}.{site.bias}" or name in folded:  # a kept bias is not filled
                result.fills.append((tensor_of(model, fold.tensor), fold.operand))
        if site.bias and name not in folded:  # kept: b / g, rotated below as a target on the stream's side
            b = getattr(norm, site.bias)
            entry(b).record.divide = name
            changes[id(b)].divide = scale
    kept_biases = [
        Target((n, by_site[n].bias), 0, "norm bias") for n in plan.kept_bias if by_site[n].bias is not None
    ]
    seen: set[tuple[int, int]] = set()
    for target in plan.writers + plan.readers + kept_biases:
        p = _tensor(model, target.holder)
        axis = target.axis % p.ndim
        if (id(p), axis) in seen:  # a tied table: E Q serves as the embedding and as lm_head
            continue
        seen.add((id(p), axis))
        rec = entry(p).record
        rec.sides.append(target.side)
        rec.rotations.append((axis, "Q", None if target.index is None else [target.index]))
    heads = getattr(plan, "heads", None)
    if heads is not None:
        # a bias that centering added to a value projection after planning (config flag) rotates with it
        bias_of = {c.param: c.bias for s in sites for c in s.consumers if c.bias is not None}
        done: set[tuple[int, int, str]] = set()
        for target in heads.targets:
            p = _tensor(model, target.holder)
            extra = []
            if target.side == "head output" and p.ndim >= 2 and names.get(id(p)) in bias_of:
                bias = model.get_parameter(bias_of[names[id(p)]])
                if bias.ndim == 1 and bias.shape[0] == p.shape[target.axis]:
                    extra.append(bias)
            for q, axis in [(p, target.axis % p.ndim)] + [(b, 0) for b in extra]:
                if (id(q), axis, target.side) in done:
                    continue
                done.add((id(q), axis, target.side))
                rec = entry(q).record
                rec.sides.append(target.side)
                rec.rotations.append((axis, "H", target.groups))
    result.changes = list(changes.values())
    result.folded = [name for name in plan.stream_sites if name in folded]
    return result


@torch.no_grad()
def apply(
    model: nn.Module,
    plan: RotationPlan,
    sites: list[NormSite],
    folded: set[str],
    matrices: dict[str, Matrix],
    *,
    defer=None,
    read=None,
) -> list[TensorRotation]:
    """Fold the stream norms ``folded`` (and the scale of the ``plan.kept_bias`` norms) and rotate, in place.

    Args:
        model: the model, centered (a LayerNorm model) and untied as the fold plan needs; the other norms
            already folded.
        plan: from ``plan_rotation``, checked by ``check_folding``.
        sites: the walk's sites (after centering): scales, biases and consumers of the stream norms.
        folded: names of the stream norms the fold plan folds (``fold_site`` was not called for them).
        matrices: ``"Q"`` (and ``"H"`` with heads) from ``matrix.make``.
        defer: ``defer(tensor, op)`` may return a function that makes ``op`` (tensor -> its new values, a
            ``Change.op``) part of the tensor's values later, called once every other tensor is assigned;
            when it returns None (or without ``defer``) the new values are computed here. ``normswap.stream``
            defers the weights that stay on disk (``Streamed.transform``): their values, and a value that
            would not fit the dtype, are known only as each is written.
        read: as ``plan_changes``'s.

    Returns:
        The record: one ``TensorRotation`` per changed tensor, in order.

    Every new value computed here (float64, from the current values) is computed before any is assigned, so
    an error while computing leaves the model as it was; the assignments are same-shape in-place copies.

    Raises:
        RotationError: a new value would not fit the tensor's dtype (float16's 65504), before any assignment.
    """
    planned = plan_changes(model, plan, sites, folded, read)
    placed: dict[torch.device, dict[str, torch.Tensor]] = {}  # the matrices, one copy per device

    def on(device: torch.device) -> dict[str, torch.Tensor]:
        if device not in placed:
            placed[device] = {name: m.values.to(device) for name, m in matrices.items()}
        return placed[device]

    new: list[tuple[torch.Tensor, torch.Tensor]] = []
    later = []
    for change in planned.changes:
        p = change.tensor
        op = change.op(on(p.device))
        deferred = defer(p, op) if defer is not None else None
        if deferred is not None:
            later.append(deferred)
            continue
        new.append((p, op(p)))
    for p, value in new:
        p.copy_(value)
    for call in later:
        call()
    for p, value in planned.fills:
        p.fill_(value)
    by_site = {s.name: s for s in sites}
    for name in planned.folded:
        by_site[name].act("rotation", folded=True)
    return planned.records


def rotation_bytes(hidden: int, head_dim: int = 0, *, tensor_numel: int = 0, tensor_bytes: int = 0,
                   held: int = 0) -> int:  # fmt: skip
    """Bytes a rotation holds beyond the weights: ``Q`` and ``H`` in float64 (``8 (hidden² + head_dim²)``),
    one tensor's new values (``tensor_bytes``) and the float64 temporaries of its blocks (the block, its
    product with the matrix, a head's copy: ``3 x 8 x min(rotate.apply.CHUNK, tensor_numel)``), plus
    ``held``: in memory, every rotated weight's new values in its dtype (``rotate.apply`` computes all before
    assigning any); streamed, nothing (each tensor is written as it is made)."""
    matrices = 8 * (hidden * hidden + head_dim * head_dim)
    return matrices + tensor_bytes + 3 * 8 * min(CHUNK, tensor_numel) + held
