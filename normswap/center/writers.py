"""From each LayerNorm's input back to the writers of the stream it reads (docs/CENTERING.md).

The search walks the recorded graph backwards through sums (``ops.ADD``), scalings constant along the
features (``ops.SCALE``) and value-preserving ops (``ops.PASS``) until it reaches a writer, whose output
axis is what centering changes (``C (W h + c) = (C W) h + C c``, SliceGPT sec. 3.2):

* ``linear`` / ``addmm`` (GPT-2's ``Conv1D``) / ``matmul`` by a parameter view (Falcon's ``x @ W.T``):
  the weight along its output axis, and the bias;
* an ``embedding`` lookup (tokens, learned positions): the table along its feature axis;
* ``_grouped_mm`` of stacked expert weights (transformers 5's MoE): each expert's output projection;
* a parameter added directly (Falcon's ``FalconLinear`` adds ``self.bias`` after the matmul);

Sums of whole rows (``ops.ROWSUM``: the routed, per-token weighted sum of the experts' outputs by
``sum``, ``index_add_`` or ``scatter_add``) are followed like sums, and a zero tensor they start from
writes nothing, so a mixture of experts is centered through each expert's output projection.
* the output of a LayerNorm of one embedding lookup (BLOOM's ``word_embeddings_layernorm``): the table
  is rewritten instead (``rewrite.table_rows``).

Anything else (another norm's output: a post-LN model; a buffer: sinusoidal positions; a non-linear op)
is a ``CenteringError`` naming the LayerNorm and the producer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from normswap import dimmap
from normswap.center import ops
from normswap.center.errors import refusal
from normswap.recording import Key, Node, Recorder


@dataclass(frozen=True)
class Ref:
    """A tensor that is a view of parameter ``param``."""

    param: str
    dims: dimmap.DimMap  # axes of the derived tensor -> axes of the parameter


@dataclass
class Write:
    """``param`` along ``axis`` is written into the stream at the tensor ``source`` (along ``out_axis``)."""

    param: str
    axis: int
    source: Key
    user: Node  # the op that uses the parameter (linear, embedding, add, or the table norm's output)
    table: str | None = None  # name of the norm whose embedding table is rewritten
    out_axis: int = -1  # -2 for ``W @ x`` (transformers' batched experts: ``bmm(W, x.unsqueeze(-1))``)


class Writers:
    """Finds, and caches, the writers of every LayerNorm input of one recording.

    Args:
        rec: the recording of the model's forward.
        kinds: norm site name -> ``"layernorm"`` or ``"rmsnorm"``, for every norm site.
    """

    def __init__(self, rec: Recorder, kinds: dict[str, str]):
        self.rec, self.kinds = rec, kinds
        self.refs: dict[Key, Ref | None] = {}
        self.cones: dict[str, tuple[set[Key], list[Write]]] = {}

    def param_ref(self, key: Key) -> Ref | None:
        """The parameter a tensor is a view of, with its dim map; None for anything else."""
        if key in self.refs:
            return self.refs[key]
        ref = None
        tid, ver = key
        if ver == 0 and tid in self.rec.params:
            name = self.rec.params[tid]
            ref = Ref(name, dimmap.identity(self.rec.tensors[name].ndim))
        else:
            node = self.rec.nodes.get(key)
            if node is not None and node.site is None and node.op in ops.PASS and 0 in node.operands:
                src = self.param_ref(node.operands[0])
                dims = ops.derive_dims(node, src.dims) if src is not None else None
                ref = Ref(src.param, dims) if dims is not None and len(dims) == node.out.ndim else None
        self.refs[key] = ref
        return ref

    def site_of(self, k: Key) -> str:
        """The first LayerNorm (in the order searched) whose input depends on tensor ``k``."""
        for site, (cone, _) in self.cones.items():
            if k in cone:
                return site
        return "?"

    def cone(self, site: str) -> tuple[set[Key], list[Write]]:
        """Every tensor between the writers and the inputs of ``site``, and the writes themselves.

        Raises:
            CenteringError: a producer that centering cannot reach exactly.
        """
        if site in self.cones:
            return self.cones[site]
        inputs = self.rec.norm_inputs.get(site)
        if not inputs:
            raise refusal(site, "its input was not seen in the trace (called with keyword arguments?)")
        seen: set[Key] = set()
        writes: list[Write] = []
        stack = list(inputs)
        while stack:
            k = stack.pop()
            if k in seen:
                continue
            seen.add(k)
            node = self.rec.nodes.get(k)
            if node is None:
                raise refusal(site, self._leaf(k))
            if node.site is not None:
                writes.append(self._table_write(site, node, k))
            elif node.op in ops.LINEAR:
                writes.extend(self._linear_writes(site, node, k))
            elif node.op == "embedding":
                ref = self.param_ref(node.operands.get(1, node.operands.get("weight")))
                if ref is None or ref.dims[-1] is None:
                    raise refusal(site, f"embedding lookup in {node.module} reads no parameter table")
                writes.append(Write(ref.param, ref.dims[-1], k, node))
            elif node.op in ops.ADD:
                for pos, other in ((0, "input"), (1, "other")):
                    value = ops.arg(node, pos, other)
                    if not isinstance(value, torch.Tensor):
                        if value not in (0, 0.0, None):
                            raise refusal(
                                site, f"its input gets the constant {value} added ({ops.where(node)})"
                            )
                        continue
                    opkey = node.operands.get(pos, node.operands.get(other))
                    ref = self.param_ref(opkey)
                    if ref is None:
                        stack.append(opkey)
                    elif value.ndim == 0 or value.shape[-1] != node.out.shape[-1] or ref.dims[-1] is None:
                        raise refusal(
                            site, f"{ref.param} is added without a feature axis ({ops.where(node)})"
                        )
                    else:
                        seen.add(opkey)
                        writes.append(Write(ref.param, ref.dims[-1], opkey, node))
            elif node.op in ops.SCALE:
                stack.append(self.scaled(site, node))
            elif node.op in ops.ROWSUM:
                parts, why = ops.rowsum_parts(node)
                if why:
                    raise refusal(site, f"its input is made by {ops.where(node)}, which {why}")
                stack.extend(parts)
            elif node.op in ops.ZEROS:
                continue
            elif node.op in ops.PASS and 0 in node.operands:
                if node.op.endswith("dropout") and ops.dropout_active(node):
                    raise refusal(site, f"dropout in training mode in {node.module}")
                stack.append(node.operands[0])
            else:
                raise refusal(site, f"its input has a non-linear producer: {ops.where(node)}")
        self.cones[site] = (seen, writes)
        return seen, writes

    def scaled(self, site: str, node: Node) -> Key:
        """The operand of a per-row scaling (scalar, or a factor of size 1 on the feature axis)."""
        tensors = [(p, a) for p, a in enumerate(node.args[:2]) if isinstance(a, torch.Tensor)]
        streams = [p for p, a in tensors if a.ndim > 0 and a.shape[-1] == node.out.shape[-1] > 1]
        if len(streams) != 1 or (node.op.startswith(("div", "__truediv", "__itruediv")) and streams != [0]):
            raise refusal(
                site, f"its input is multiplied by a tensor varying along the features ({ops.where(node)})"
            )
        return node.operands[streams[0]]

    def _leaf(self, k: Key) -> str:
        if k[0] in self.rec.buffers:
            name = self.rec.buffers[k[0]]
            return f"it reads the buffer {name} (e.g. sinusoidal positions); only parameters can be centered"
        return "it reads a tensor made outside the model's ops (an input or a constant)"

    def _linear_writes(self, site: str, node: Node, k: Key) -> list[Write]:
        if node.op == "linear":
            weight, bias, w_axis = (1, "weight"), (2, "bias"), 0
        elif node.op == "addmm":
            weight, bias, w_axis = (2, "mat2"), (0, "input"), -1
        elif "grouped_mm" in node.op:  # (S, K) x stacked (E, K, N) -> (S, N)
            weight, bias, w_axis = (1, "mat_b" if "mat_b" in node.operands else "weight"), None, -1
        else:
            weight, bias, w_axis = (1, "other"), None, -1
        wkey = node.operands.get(weight[0], node.operands.get(weight[1]))
        ref = self.param_ref(wkey) if wkey is not None else None
        out_axis = -1
        matrix = node.op in ("matmul", "__matmul__", "mm", "bmm") and node.args[1].ndim >= 2
        if ref is None and matrix and 0 in node.operands:
            ref, w_axis, out_axis = self.param_ref(node.operands[0]), -2, -2  # W @ x: W's rows are written
        if ref is None or ref.dims[w_axis] is None:
            raise refusal(site, f"its input is written by {ops.where(node)} whose weight is not a parameter")
        writes = [Write(ref.param, ref.dims[w_axis], k, node, out_axis=out_axis)]
        bkey = node.operands.get(bias[0], node.operands.get(bias[1])) if bias else None
        if bkey is not None:
            bref = self.param_ref(bkey)
            if bref is None or bref.dims[-1] is None:
                raise refusal(site, f"the bias of {ops.where(node)} is not a parameter")
            writes.append(Write(bref.param, bref.dims[-1], k, node))
        return writes

    def _table_write(self, site: str, node: Node, k: Key) -> Write:
        """A norm output written into ``site``'s input: exact only for a norm of one embedding lookup."""
        other = node.site
        if self.kinds.get(other) == "layernorm":
            cone, writes = self.cone(other)
            op_names = {self.rec.nodes[c].op for c in cone if c in self.rec.nodes}
            if len(writes) == 1 and writes[0].user.op == "embedding" and not op_names & ops.ADD:
                return Write(writes[0].param, writes[0].axis, k, node, table=other)
        raise refusal(
            site,
            f"the output of {self.kinds.get(other, 'norm')} {other} is added into its input, carrying that "
            "norm's weight and bias into the residual stream (a post-LN model); only pre-LN models convert",
        )
