"""Per-head rotation of attention values (SpinQuant's R2): ``v -> v H`` on each head, undone in ``o_proj``.

Attention mixes the value vectors of one head with weights that do not depend on them: per head,
``attn(q, k, v H) = attn(q, k, v) H``. So an orthogonal ``H`` (head_dim x head_dim) applied to the rows
of each head of the value projection (and its bias) and to the input columns of each head of the output
projection leaves the model unchanged (Liu et al., "SpinQuant", ICLR 2025, sec. 3.1, R2). One ``H`` serves
every head, so grouped-query attention (a key/value head shared by several query heads) needs nothing more.

Found in the recorded forward, by dataflow (no names):

* the attention ops: ``scaled_dot_product_attention`` (value: its third argument), or a matrix product
  whose left operand comes from a ``softmax`` (eager attention: ``softmax(q kᵀ) @ v``);
* back from the value through value-preserving ops (``center.ops.PASS``: views, transposes, the split of a
  fused qkv, ``repeat_kv``'s expand) to the linear map that writes it, the value projection;
* forward from the attention output through value-preserving ops to the linear map that reads it, the
  output projection.

Which features form a head comes from replaying feature indices through the recorded ops
(``center.ops.replay``), as centering does: the last axis of the value tensor is the head's dimension, so
each of its rows is one head's features of the value projection, in order; for the output projection, the
index ``head * head_dim + d`` replayed from the attention output to its input gives each head's columns.
Anything else on those paths (a norm of the values, a pad, another reader) refuses the head rotation.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from normswap.center import ops
from normswap.center.errors import CenteringError
from normswap.recording import Key, Node, Recorder
from normswap.rotate.plan import RotationError, StreamWriters, _holder
from normswap.rotate.plan import _refuse as refuse_centering


class HeadRotationError(RotationError):
    """The per-head rotation is refused (the residual stream's rotation alone may still be possible)."""


SOFTMAX = {"softmax", "_softmax", "softmax_"}
PASS = ops.PASS | {"broadcast_to"}  # value-preserving ops a head's values may pass through


@dataclass
class HeadTarget:
    """One parameter rotated per head: ``groups`` (index tensors along ``axis``, each one head's features in
    head-dimension order) each multiplied by ``H``."""

    holder: tuple[str, str]
    axis: int
    side: str  # "head output" (value projection) or "head input" (output projection)
    groups: list[torch.Tensor] = field(default_factory=list)


@dataclass
class HeadPlan:
    """The per-head rotation: ``size`` (head_dim, the order of ``H``) and the targets."""

    size: int
    targets: list[HeadTarget] = field(default_factory=list)
    attentions: list[str] = field(default_factory=list)  # module of each attention op rotated


def _refuse(where: str, what: str):
    return HeadRotationError(f"cannot rotate the attention heads in {where}: {what}")


def _attention_ops(rec: Recorder) -> list[tuple[Node, Key]]:
    """Every attention op and the key of its value operand, in forward order."""
    found = []
    for node in sorted(rec.nodes.values(), key=lambda n: n.order):
        if node.op == "scaled_dot_product_attention":
            value = node.operands.get(2, node.operands.get("value"))
            if value is not None:
                found.append((node, value))
        elif node.op in ("matmul", "__matmul__", "bmm") and 0 in node.operands and 1 in node.operands:
            if _from_softmax(rec, node.operands[0]):
                found.append((node, node.operands[1]))
    return found


def _from_softmax(rec: Recorder, key: Key) -> bool:
    """Whether ``key`` is a softmax output, through value-preserving ops (dropout, casts, views)."""
    for _ in range(16):
        node = rec.nodes.get(key)
        if node is None:
            return False
        if node.op in SOFTMAX:
            return True
        if node.op not in ops.PASS or 0 not in node.operands:
            return False
        key = node.operands[0]
    return False


def _chain_back(rec: Recorder, finder, key: Key, where: str) -> tuple[Node, list[Node], list]:
    """From the value operand back through ``PASS`` ops to the linear node that made it.

    A parameter added on the way (Falcon's ``FalconLinear`` adds its bias after the product) is that
    linear map's bias.

    Returns:
        ``(linear node, the nodes from the linear's output to the value in forward order, the added
        parameters as ``center.writers.Ref``)``.
    """
    chain: list[Node] = []
    biases = []
    while True:
        node = rec.nodes.get(key)
        if node is None:
            raise _refuse(where, "its values do not come from a linear map")
        if node.op in ops.LINEAR and node.site is None:
            return node, chain[::-1], biases
        if node.op in ops.ADD and node.op.startswith(("add", "__add", "__iadd", "__radd")):
            refs = {p: finder.param_ref(k) for p, k in node.operands.items()}
            params = [(p, r) for p, r in refs.items() if r is not None]
            rest = [p for p, r in refs.items() if r is None]
            if len(params) == 1 and len(rest) == 1 and params[0][1].dims[-1] is not None:
                biases.append(params[0][1])
                chain.append(node)
                key = node.operands[rest[0]]
                continue
        if node.op not in PASS or 0 not in node.operands or node.site is not None:
            raise _refuse(where, f"its values pass through {ops.where(node)}, which a rotation would change")
        if node.op.endswith("dropout") and ops.dropout_active(node):
            raise _refuse(where, f"dropout in training mode in {node.module}")
        chain.append(node)
        key = node.operands[0]


def _replay(node: Node, index: torch.Tensor) -> torch.Tensor:
    """``ops.replay``, with a bias add (a ``_chain_back`` link) keeping the feature layout."""
    if node.op in ops.ADD:
        return index.expand(node.out.shape)
    return ops.replay(node, index)


def _uses_ok(rec: Recorder, chain_keys: list[Key], index_of: dict[Key, torch.Tensor], rotated: set[int],
             attention: Node):  # fmt: skip
    """Every use of a tensor on the value path is the next op of the path, or a view that holds none of the
    rotated features (the q and k slices of a fused qkv); returns the first offending use or None."""
    inside = set(chain_keys)
    for k in chain_keys:
        for use in rec.uses.get(k, []):
            if isinstance(use, tuple):
                return use[0]
            if use.key in inside:
                continue
            if use.out is not None and use.op in PASS and use.operands.get(0) == k and k in index_of:
                seen = ops.replay(use, index_of[k]).reshape(-1).tolist()
                if not rotated & set(seen):
                    continue
            if use is attention:
                continue
            return ops.where(use)
    return None


def plan_heads(model: nn.Module, rec: Recorder, plan) -> HeadPlan:
    """The per-head rotation of every attention of the recorded forward (module docstring).

    Args:
        model: the model (for the value projection's output width).
        rec: the rotation plan's recording.
        plan: the ``RotationPlan`` (its targets name the holders the same way).

    Raises:
        RotationError: no attention found, head sizes differ, or an attention whose values or output
            pass through anything but value-preserving ops.
    """
    finder = StreamWriters(rec, {})
    attentions = _attention_ops(rec)
    if not attentions:
        raise _refuse("the model", "no attention op (scaled_dot_product_attention or softmax @ v) was found")
    result: HeadPlan | None = None
    for node, value in attentions:
        where = node.module or node.op
        linear, chain, added = _chain_back(rec, finder, value, where)
        lin_key = linear.key
        try:
            writes = finder._linear_writes(where, linear, lin_key)
        except CenteringError as error:
            raise refuse_centering(error) from error
        out = linear.out
        index = torch.arange(out.shape[-1], device="cpu").expand(out.shape)
        index_of = {lin_key: index}
        previous = lin_key
        for n in chain:
            index_of[n.key] = _replay(n, index_of[previous])
            previous = n.key
        v = index_of[chain[-1].key] if chain else index
        if v.ndim < 2:
            raise _refuse(where, "its values have no head axis")
        size = v.shape[-1]
        rows = torch.unique(v.reshape(-1, size), dim=0)
        flat = rows.reshape(-1)
        if torch.unique(flat).numel() != flat.numel():
            raise _refuse(where, "its heads share features of the value projection")
        rotated = set(flat.tolist())
        bad = _uses_ok(rec, [lin_key, *[n.key for n in chain]], index_of, rotated, node)
        if bad is not None:
            raise _refuse(where, f"its values are also read by {bad}")
        reader, groups_in = _output_groups(rec, node, size, where)
        if result is None:
            result = HeadPlan(size)
        elif result.size != size:
            raise _refuse(where, f"its heads have {size} features, others {result.size}: one H serves all")
        v_groups = [r.clone() for r in rows]
        for param, axis in [(w.param, w.axis) for w in writes] + [(r.param, r.dims[-1]) for r in added]:
            holder = _holder(list(rec.owners.get(param, [])), linear.module, param)
            result.targets.append(HeadTarget(holder, axis, "head output", v_groups))
        o_weight, o_axis, o_module = reader
        holder = _holder(list(rec.owners.get(o_weight, [])), o_module, o_weight)
        result.targets.append(HeadTarget(holder, o_axis, "head input", groups_in))
        result.attentions.append(where)
    _check_disjoint(result)
    return result


def _output_groups(rec: Recorder, node: Node, size: int, where: str):
    """From the attention output forward through ``PASS`` ops to the linear map reading it.

    Returns:
        ``((weight param, its input axis, module), groups)``: each head's input columns, in head-dimension
        order.
    """
    out = node.out
    if out.ndim < 3 or out.shape[-1] != size:
        raise _refuse(where, f"its output of shape {tuple(out.shape)} has no head axis before the last")
    heads = out.shape[-3]
    code = torch.arange(heads, device="cpu").reshape(-1, 1, 1) * size + torch.arange(size, device="cpu")
    index = code.expand(out.shape)
    key = node.key
    while True:
        uses = [u for u in rec.uses.get(key, []) if not isinstance(u, tuple)]
        others = [u for u in rec.uses.get(key, []) if isinstance(u, tuple)]
        if others or len(uses) != 1:
            what = others[0][0] if others else ", ".join(ops.where(u) for u in uses) or "nothing"
            raise _refuse(where, f"its output is read by {what}, not by one chain of views into a linear map")
        last = ops.where(uses[0])
        use = uses[0]
        if use.op in PASS and use.operands.get(0) == key:
            index = ops.replay(use, index)
            key = use.key
            continue
        reader = _reader_weight(rec, use, key)
        if reader is not None:
            param, axis = reader
            cols = index.reshape(-1, index.shape[-1])
            cols = cols - cols.min(dim=1, keepdim=True).values  # batch x heads flattened (BLOOM): per row
            if not bool((cols == cols[:1]).all()):
                raise _refuse(where, "the output projection sees the heads in different layouts")
            col = cols[0]
            groups = [torch.nonzero(col // size == h).reshape(-1) for h in range(heads)]
            groups = [g[torch.argsort(col[g] % size)] for g in groups if g.numel()]
            if any(g.numel() != size for g in groups):
                raise _refuse(where, "the output projection does not read whole heads")
            return (param, axis, use.module), groups
        break
    raise _refuse(where, f"its output reaches {last}, not a linear map through views only")


def _reader_weight(rec: Recorder, use: Node, key: Key) -> tuple[str, int] | None:
    """``(weight param, its contracted axis)`` when ``use`` multiplies ``key`` (as the activation, along its
    last axis) by a parameter: ``linear(x, W)``, ``addmm(b, x, W)`` (GPT-2's ``Conv1D``), ``x @ W.T``."""
    if use.op == "linear" and use.operands.get(0) == key:
        wkey, pick = use.operands.get(1, use.operands.get("weight")), -1  # x[..., k] with weight[:, k]
    elif use.op == "addmm" and use.operands.get(1, use.operands.get("mat1")) == key:
        wkey, pick = use.operands.get(2, use.operands.get("mat2")), -2
    elif use.op in ("matmul", "__matmul__", "mm") and use.operands.get(0) == key:
        wkey, pick = use.operands.get(1, use.operands.get("other")), -2
    else:
        return None
    ref = _param_ref(rec, wkey)
    if ref is None or len(ref[1]) < 2 or ref[1][pick] is None:
        return None
    return ref[0], ref[1][pick]


def _param_ref(rec: Recorder, key: Key):
    ref = StreamWriters(rec, {}).param_ref(key) if key is not None else None
    return None if ref is None else (ref.param, ref.dims)


def _check_disjoint(plan: HeadPlan) -> None:
    """A parameter rotated twice on the same features (one projection read by two attentions) is refused."""
    seen: dict[tuple[tuple[str, str], int], set[int]] = {}
    for t in plan.targets:
        key = (t.holder, t.axis)
        feats = {int(i) for g in t.groups for i in g.tolist()}
        if feats & seen.get(key, set()):
            raise _refuse(t.holder[0], "its features are rotated by two attentions")
        seen.setdefault(key, set()).update(feats)
