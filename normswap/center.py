"""LayerNorm -> RMSNorm by centering what is written into each LayerNorm's input (SliceGPT).

A LayerNorm is an RMSNorm of its centered input, with the same eps, weight and bias (Ba et al., 2016;
Zhang & Sennrich, 2019)::

    LayerNorm(x) = RMSNorm(x - mean(x)) * (offset + w) + b          mean over the last axis

so on a zero-mean input the two are the same function. In a pre-LN transformer every LayerNorm reads a
sum of *writes* (token and position embeddings, attention-output and MLP-down projections with their
biases), and every reader of that residual stream is a LayerNorm, which cannot see the stream's mean.
Subtracting the mean over the hidden axis from each writer's output rows (and bias, and embedding rows)
therefore leaves the model's function unchanged and makes the stream zero-mean, after which each
LayerNorm may be replaced by an RMSNorm: the computational invariance of SliceGPT (Ashkboos et al., 2024,
sec. 3.2). The same holds for any LayerNorm whose input is a sum of linear maps, e.g. per-head q/k
LayerNorms, where the rows of the producing projection are centered head by head.

Nothing here reads class or parameter names. One traced forward records every torch op; from each
LayerNorm's input the recorder walks back through sums and value-preserving ops (views, casts, dropout
in eval, per-row scalings) to the writers, replays those ops on tensors of feature indices to learn
which output rows are normalized together, and checks that the centered tensors are read by nothing but
LayerNorms. Everything is planned first; ``prepare`` then allocates every new tensor, and only ``commit``
touches the model (assignments that cannot fail half-way), so a refusal (``CenteringError``) or an error
before the commit leaves the model exactly as it was.

Special cases, each derived from the dataflow:

* a writer parameter shared with a non-writer use (an embedding tied to ``lm_head``): the other holder
  gets its own copy of the original values first (``tie_word_embeddings`` becomes False);
* a LayerNorm whose bias cannot be folded because a consumer has no bias: if one of the config's
  ``*bias*`` flags adds exactly such biases (found by building the model on the meta device with the
  flag set), zero biases are added and the flag is set, so a saved checkpoint loads with them; otherwise
  the norm keeps its weight and bias as an RMSNorm with bias (``BiasedRMSNorm``) and the site says so;
* a LayerNorm applied to an embedding lookup alone (BLOOM's ``word_embeddings_layernorm``): its output
  depends on the token id only, so the table is rewritten so that the norm, now an RMSNorm with a
  constant weight ``s``, outputs the centered original rows exactly (``_table_rows``);
* post-LN models (a LayerNorm output added into another LayerNorm's input), non-parameter positions
  (sinusoids), non-linear producers, streams that an RMSNorm or the model output also reads, and
  RMSNorm-only models (never centered: it would change them) are refused or left alone.

Formulas: docs/CENTERING.md.
"""

from __future__ import annotations

import copy
import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from normswap import dimmap
from normswap.errors import NormswapError
from normswap.fold import untie_config
from normswap.kernels import FusedRMSNorm, rms_norm
from normswap.sites import NormSite
from normswap.walk import _IGNORED, Walk, _example_inputs, _func_name


class CenteringError(NormswapError):
    """``norm="rmsnorm"`` asked of a model that cannot be converted exactly; names the site and why.

    Raised before anything is changed: the model is left bit-identical.
    """


Key = tuple[int, int]  # (id(tensor), version): in-place ops give a tensor a new version

_ADD = {"add", "add_", "__add__", "__iadd__", "__radd__", "sub", "sub_", "__sub__", "__isub__", "__rsub__"}
_SCALE = {"mul", "mul_", "__mul__", "__imul__", "__rmul__", "div", "div_", "__truediv__", "__itruediv__",
          "neg", "__neg__"}  # fmt: skip
_LINEAR = {"linear", "matmul", "__matmul__", "mm", "addmm", "bmm"}
_PASS = (dimmap.SAME_SHAPE | dimmap.RESHAPE | dimmap.TRANSPOSE | dimmap.SPLIT
         | {"__getitem__", "index_select", "expand", "expand_as", "narrow", "select"})  # fmt: skip
# Ops whose result does not depend on the values they read (a fresh tensor of the same shape).
_VALUE_FREE = {"zeros_like", "ones_like", "empty_like", "full_like", "new_zeros", "new_ones", "new_empty"}
_CHUNK = 1 << 22  # float64 elements per block of centering arithmetic (32 MiB)


@dataclass(eq=False)
class _Node:
    """One recorded op output (or a norm module's output when ``site`` is set)."""

    op: str
    func: Any
    args: tuple
    kwargs: dict
    module: str
    operands: dict  # argument position (int) or keyword -> Key of the tensor passed there
    out: torch.Tensor
    piece: int | None = None  # index of ``out`` in a tuple result (split, chunk, unbind)
    order: int = 0
    site: str | None = None
    key: Key | None = None  # the version of ``out`` this node made


@dataclass(frozen=True)
class _Ref:
    param: str
    dims: dimmap.DimMap  # axes of the derived tensor -> axes of the parameter


@dataclass
class _Write:
    """``param`` along ``axis`` is written into the stream at the tensor ``source`` (its last axis)."""

    param: str
    axis: int
    source: Key
    user: _Node  # the op that uses the parameter (linear, embedding, add, or the table norm's output)
    table: str | None = None  # name of the norm whose embedding table is rewritten


class _Recorder(TorchFunctionMode):
    """Records every torch op of one forward as ``_Node``s, with the uses of each tensor version."""

    def __init__(self, model: nn.Module, site_names: list[str]):
        super().__init__()
        self.names = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
        self.params: dict[int, str] = {}
        self.tensors: dict[str, torch.Tensor] = {}
        self.owners: dict[str, list[tuple[str, str]]] = defaultdict(list)
        for mod_name, mod in model.named_modules(remove_duplicate=False):
            for attr, p in mod._parameters.items():
                if p is not None:
                    qual = self.params.setdefault(id(p), f"{mod_name}.{attr}" if mod_name else attr)
                    self.tensors[qual] = p
                    if (mod_name, attr) not in self.owners[qual]:
                        self.owners[qual].append((mod_name, attr))
        self.buffers = {id(b): n for n, b in model.named_buffers(remove_duplicate=False)}
        self.site_of = {id(model.get_submodule(n)): n for n in site_names}
        self.version: dict[int, int] = {}
        self.nodes: dict[Key, _Node] = {}
        self.uses: dict[Key, list] = defaultdict(list)  # _Node, ("norm", site) or ("output", None)
        self.norm_inputs: dict[str, list[Key]] = defaultdict(list)
        self.keep: list[torch.Tensor] = []  # holds every seen tensor alive so ids are not reused
        self.stack: list[str] = []
        self.inside = 0  # >0 while a norm module runs: its internal ops are not part of the graph
        self.count = 0

    def key(self, t: torch.Tensor) -> Key:
        return (id(t), self.version.get(id(t), 0))

    def pre_hook(self, module, args):
        self.stack.append(self.names.get(id(module), type(module).__name__))
        site = self.site_of.get(id(module))
        if site is not None:
            if self.inside == 0 and args and isinstance(args[0], torch.Tensor):
                k = self.key(args[0])
                self.keep.append(args[0])
                self.uses[k].append(("norm", site))
                self.norm_inputs[site].append(k)
            self.inside += 1

    def post_hook(self, module, args, output):
        if self.stack:
            self.stack.pop()
        site = self.site_of.get(id(module))
        if site is None:
            return
        self.inside -= 1
        if self.inside == 0 and isinstance(output, torch.Tensor) and self.norm_inputs[site]:
            self.keep.append(output)
            self.count += 1
            k = self.key(output)
            operands = {0: self.norm_inputs[site][-1]}
            self.nodes[k] = _Node("norm", None, (), {}, site, operands, output, None, self.count, site, k)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.inside:
            return out
        name = _func_name(func)
        if name in _IGNORED:
            return out
        operands = {i: self.key(a) for i, a in enumerate(args) if isinstance(a, torch.Tensor)}
        operands.update({k: self.key(a) for k, a in kwargs.items() if isinstance(a, torch.Tensor)})
        flat, _ = tree_flatten((args, kwargs))
        inputs = [a for a in flat if isinstance(a, torch.Tensor)]
        input_keys = [self.key(a) for a in inputs]
        self.keep.extend(inputs)
        module = self.stack[-1] if self.stack else ""
        mutated = bool(args) and isinstance(args[0], torch.Tensor) and _mutates(name)
        results = list(out) if isinstance(out, tuple | list) else [out]
        if not mutated and any(o is a for o in results for a in inputs):
            return out  # an alias of an input (x.contiguous() of a contiguous x): no new value
        if mutated:  # the first argument changes in place: it becomes a new version
            self.version[id(args[0])] = self.version.get(id(args[0]), 0) + 1
            results = [args[0]]
        made = []
        for i, o in enumerate(results):
            if not isinstance(o, torch.Tensor):
                continue
            self.count += 1
            piece = i if isinstance(out, tuple | list) and not mutated else None
            k = self.key(o)
            node = _Node(name, func, tuple(args), dict(kwargs), module, operands, o, piece, self.count, key=k)
            self.nodes[k] = node
            self.keep.append(o)
            made.append(node)
        for k in input_keys:  # an op with no tensor result (x.tolist()) still reads its inputs
            self.uses[k].extend(made or [_Node(name, func, (), {}, module, {}, None)])
        return out


def _mutates(name: str) -> bool:
    return (
        name == "__setitem__"
        or (name.startswith("__i") and name.endswith("__"))
        or (name.endswith("_") and not name.startswith("_") and name != "requires_grad_")
    )


def _record(model: nn.Module, site_names: list[str], input_ids: torch.Tensor | None) -> _Recorder:
    """Run one forward under a ``_Recorder``; hooks removed and module modes restored afterwards."""
    recorder = _Recorder(model, site_names)
    modes = {m: m.training for m in model.modules()}
    model.eval()
    handles = [
        nn.modules.module.register_module_forward_pre_hook(recorder.pre_hook),
        nn.modules.module.register_module_forward_hook(recorder.post_hook),
    ]
    try:
        with torch.no_grad(), recorder:
            inputs = _example_inputs(model, input_ids)
            try:
                output = model(**inputs)
            except TypeError:
                inputs.pop("use_cache", None)
                output = model(**inputs)
    finally:
        for h in handles:
            h.remove()
        for m, mode in modes.items():
            m.train(mode)
    flat, _ = tree_flatten(output.to_tuple() if hasattr(output, "to_tuple") else output)
    for t in flat:
        if isinstance(t, torch.Tensor):
            recorder.uses[recorder.key(t)].append(("output", None))
    return recorder


def _arg(node: _Node, pos: int, name: str, default=None):
    return node.args[pos] if len(node.args) > pos else node.kwargs.get(name, default)


def _dropout_active(node: _Node) -> bool:
    """``F.dropout(input, p=0.5, training=True)`` as called: does it drop anything?"""
    return bool(_arg(node, 2, "training", True)) and _arg(node, 1, "p", 0.5) > 0


def _derive_dims(node: _Node, dims: dimmap.DimMap) -> dimmap.DimMap | None:
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
        a, b = _arg(node, 1, "dim0"), _arg(node, 2, "dim1")
        return dimmap.after_transpose(dims, a % src.ndim, b % src.ndim)
    if name == "permute":
        order = node.args[1:] if len(node.args) > 2 else (_arg(node, 1, "dims"))
        return dimmap.after_permute(dims, [o % src.ndim for o in order])
    if name == "__getitem__":
        return dimmap.after_getitem(dims, src.shape, node.args[1])
    return None


def _replay(node: _Node, index: torch.Tensor) -> torch.Tensor:
    """``node``'s op applied to a tensor of feature indices standing in for its first argument."""
    if node.op in dimmap.SAME_SHAPE or node.op in _SCALE:
        return index.expand(node.out.shape)
    try:
        result = node.func(index, *node.args[1:], **node.kwargs)
    except RuntimeError:  # a view the broadcast (stride-0) index tensor cannot take: use a real copy
        result = node.func(index.contiguous(), *node.args[1:], **node.kwargs)
    return result[node.piece] if node.piece is not None else result


@dataclass
class _Flag:
    name: str
    biases: dict[str, tuple[str, torch.Size]]  # module -> (attribute, shape) of the bias the flag adds


class _Planner:
    """Finds the writers of every LayerNorm input and checks that centering them is exact."""

    def __init__(self, model: nn.Module, walk: Walk, rec: _Recorder):
        self.model, self.walk, self.rec = model, walk, rec
        self.kinds = {s.name: s.kind for s in walk.sites}
        self.refs: dict[Key, _Ref | None] = {}
        self.cones: dict[str, tuple[set[Key], list[_Write]]] = {}

    def param_ref(self, key: Key) -> _Ref | None:
        """The parameter a tensor is a view of, with its dim map; None for anything else."""
        if key in self.refs:
            return self.refs[key]
        ref = None
        tid, ver = key
        if ver == 0 and tid in self.rec.params:
            name = self.rec.params[tid]
            ref = _Ref(name, dimmap.identity(self.rec.tensors[name].ndim))
        else:
            node = self.rec.nodes.get(key)
            if node is not None and node.site is None and node.op in _PASS and 0 in node.operands:
                src = self.param_ref(node.operands[0])
                dims = _derive_dims(node, src.dims) if src is not None else None
                ref = _Ref(src.param, dims) if dims is not None and len(dims) == node.out.ndim else None
        self.refs[key] = ref
        return ref

    def _fail(self, site: str, what: str) -> CenteringError:
        return CenteringError(f"cannot convert LayerNorm {site} to RMSNorm exactly: {what}")

    def _where(self, node: _Node) -> str:
        return f"{node.op} in {node.module}" if node.module else node.op

    def cone(self, site: str) -> tuple[set[Key], list[_Write]]:
        """Every tensor between the writers and the inputs of ``site``, and the writes themselves."""
        if site in self.cones:
            return self.cones[site]
        inputs = self.rec.norm_inputs.get(site)
        if not inputs:
            raise self._fail(site, "its input was not seen in the trace (called with keyword arguments?)")
        seen: set[Key] = set()
        writes: list[_Write] = []
        stack = list(inputs)
        while stack:
            k = stack.pop()
            if k in seen:
                continue
            seen.add(k)
            node = self.rec.nodes.get(k)
            if node is None:
                raise self._fail(site, self._leaf(k))
            if node.site is not None:
                writes.append(self._table_write(site, node, k))
            elif node.op in _LINEAR:
                writes.extend(self._linear_writes(site, node, k))
            elif node.op == "embedding":
                ref = self.param_ref(node.operands.get(1, node.operands.get("weight")))
                if ref is None or ref.dims[-1] is None:
                    raise self._fail(site, f"embedding lookup in {node.module} reads no parameter table")
                writes.append(_Write(ref.param, ref.dims[-1], k, node))
            elif node.op in _ADD:
                for pos, other in ((0, "input"), (1, "other")):
                    value = _arg(node, pos, other)
                    if not isinstance(value, torch.Tensor):
                        if value not in (0, 0.0, None):
                            raise self._fail(
                                site, f"its input gets the constant {value} added ({self._where(node)})"
                            )
                        continue
                    opkey = node.operands.get(pos, node.operands.get(other))
                    ref = self.param_ref(opkey)
                    if ref is None:
                        stack.append(opkey)
                    elif value.ndim == 0 or value.shape[-1] != node.out.shape[-1] or ref.dims[-1] is None:
                        raise self._fail(
                            site, f"{ref.param} is added without a feature axis ({self._where(node)})"
                        )
                    else:
                        seen.add(opkey)
                        writes.append(_Write(ref.param, ref.dims[-1], opkey, node))
            elif node.op in _SCALE:
                stack.append(self._scaled(site, node))
            elif node.op in _PASS and 0 in node.operands:
                if node.op.endswith("dropout") and _dropout_active(node):
                    raise self._fail(site, f"dropout in training mode in {node.module}")
                stack.append(node.operands[0])
            else:
                raise self._fail(site, f"its input has a non-linear producer: {self._where(node)}")
        self.cones[site] = (seen, writes)
        return seen, writes

    def _leaf(self, k: Key) -> str:
        if k[0] in self.rec.buffers:
            name = self.rec.buffers[k[0]]
            return f"it reads the buffer {name} (e.g. sinusoidal positions); only parameters can be centered"
        return "it reads a tensor made outside the model's ops (an input or a constant)"

    def _scaled(self, site: str, node: _Node) -> Key:
        """The operand of a per-row scaling (scalar, or a factor of size 1 on the feature axis)."""
        tensors = [(p, a) for p, a in enumerate(node.args[:2]) if isinstance(a, torch.Tensor)]
        streams = [p for p, a in tensors if a.ndim > 0 and a.shape[-1] == node.out.shape[-1] > 1]
        if len(streams) != 1 or (node.op.startswith(("div", "__truediv", "__itruediv")) and streams != [0]):
            raise self._fail(
                site, f"its input is multiplied by a tensor varying along the features ({self._where(node)})"
            )
        return node.operands[streams[0]]

    def _linear_writes(self, site: str, node: _Node, k: Key) -> list[_Write]:
        if node.op == "linear":
            weight, bias, w_axis = (1, "weight"), (2, "bias"), 0
        elif node.op == "addmm":
            weight, bias, w_axis = (2, "mat2"), (0, "input"), -1
        else:
            weight, bias, w_axis = (1, "other"), None, -1
        wkey = node.operands.get(weight[0], node.operands.get(weight[1]))
        ref = self.param_ref(wkey) if wkey is not None else None
        if ref is None or ref.dims[w_axis] is None:
            raise self._fail(
                site, f"its input is written by {self._where(node)} whose weight is not a parameter"
            )
        writes = [_Write(ref.param, ref.dims[w_axis], k, node)]
        bkey = node.operands.get(bias[0], node.operands.get(bias[1])) if bias else None
        if bkey is not None:
            bref = self.param_ref(bkey)
            if bref is None or bref.dims[-1] is None:
                raise self._fail(site, f"the bias of {self._where(node)} is not a parameter")
            writes.append(_Write(bref.param, bref.dims[-1], k, node))
        return writes

    def _table_write(self, site: str, node: _Node, k: Key) -> _Write:
        """A norm output written into ``site``'s input: exact only for a norm of one embedding lookup."""
        other = node.site
        if self.kinds.get(other) == "layernorm":
            cone, writes = self.cone(other)
            ops = {self.rec.nodes[c].op for c in cone if c in self.rec.nodes}
            if len(writes) == 1 and writes[0].user.op == "embedding" and not ops & _ADD:
                return _Write(writes[0].param, writes[0].axis, k, node, table=other)
        raise self._fail(
            site,
            f"the output of {self.kinds.get(other, 'norm')} {other} is added into its input, carrying that "
            "norm's weight and bias into the residual stream (a post-LN model); only pre-LN models convert",
        )


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

    def to_dict(self) -> dict[str, Any]:
        return dict(vars(self))


@dataclass
class _Plan:
    result: CenterResult
    groups: dict[tuple[str, int], list[torch.Tensor]]  # (param, axis) -> index groups centered together
    tables: dict[str, tuple[str, NormSite]]  # embedding param -> (norm site name, site)
    untie: list[tuple[str, str]]
    flags: list[_Flag]
    resolved: list[NormSite]
    tensors: dict[str, torch.Tensor]  # qualified name -> the Parameter object


def plan_centering(
    model: nn.Module,
    walk: Walk,
    input_ids: torch.Tensor | None = None,
    *,
    untie: bool = True,
    add_biases: bool = True,
) -> _Plan:
    """Plan the centering of ``model`` (see the module docstring); changes nothing.

    Raises:
        CenteringError: the conversion would not be exact; the message names the site and the reason.
    """
    result = CenterResult()
    layer = [s for s in walk.sites if s.kind == "layernorm"]
    if not layer:
        result.note = "no LayerNorm: nothing to center (centering an RMSNorm model would change it)"
        return _Plan(result, {}, {}, [], [], [], {})
    rec = _record(model, [s.name for s in walk.sites], input_ids)
    planner = _Planner(model, walk, rec)
    cone: set[Key] = set()
    writes: dict[Key, list[_Write]] = defaultdict(list)
    for site in layer:
        keys, site_writes = planner.cone(site.name)
        cone |= keys
        for w in site_writes:
            if w not in writes[w.source]:
                writes[w.source].append(w)
    index, feeds = _propagate(planner, cone, writes)
    groups, tables = _groups(planner, layer, index, feeds, writes)
    _check_readers(planner, cone, index, feeds, groups, writes)
    result.sites = [s.name for s in layer]
    result.writers = [
        f"{p}[{a}]" + (f" x{len(g)} groups" if len(g) > 1 else "") for (p, a), g in groups.items()
    ]
    to_untie = _untie_plan(planner, writes, untie)
    for module, attr in to_untie:
        p = model.get_submodule(module)._parameters[attr]
        result.untied.append(f"{module}.{attr}" if module else attr)
        result.untie_bytes += p.numel() * p.element_size()
    flags, resolved = _bias_flags(model, walk, layer) if add_biases else ([], [])
    result.flags = [f.name for f in flags]
    result.biases_added = [f"{m}.{a}" for f in flags for m, (a, _) in f.biases.items()]
    result.kept_bias = [s.name for s in layer if _bias_blocked(s) and s not in resolved]
    for emb, (norm, _) in tables.items():
        result.tables.append(f"{emb} -> {norm}")
    return _Plan(result, groups, tables, to_untie, flags, resolved, rec.tensors)


def _in_order(rec: _Recorder, keys: set[Key]) -> list[Key]:
    """``keys`` in the order the forward made them (parameters first)."""
    return sorted(keys, key=lambda k: rec.nodes[k].order if k in rec.nodes else -1)


def _propagate(planner: _Planner, cone: set[Key], writes: dict[Key, list[_Write]]):
    """Feature-index tensors and the set of writing sources of every tensor in the cone, in op order."""
    rec = planner.rec
    index: dict[Key, torch.Tensor] = {}
    feeds: dict[Key, frozenset[Key]] = {}
    for k in _in_order(rec, cone):
        node = rec.nodes.get(k)
        if k in writes:
            t = node.out if node is not None else rec.tensors[writes[k][0].param]
            index[k] = torch.arange(t.shape[-1]).expand(t.shape)
            feeds[k] = frozenset([k])
        elif node.op in _ADD:
            parts = [(index[o], feeds[o]) for o in node.operands.values() if o in index]
            first = parts[0][0].expand(node.out.shape)
            if any(not torch.equal(i.expand(node.out.shape), first) for i, _ in parts[1:]):
                why = f"{planner._where(node)} adds tensors whose features are laid out differently"
                raise planner._fail(_site_of(planner, k), why)
            index[k], feeds[k] = first, frozenset().union(*(f for _, f in parts))
        else:
            src = planner._scaled("", node) if node.op in _SCALE else node.operands[0]
            index[k], feeds[k] = _replay(node, index[src]), feeds[src]
    return index, feeds


def _groups(planner: _Planner, layer: list[NormSite], index, feeds, writes):
    """Index groups normalized together, per written (param, axis); checks that they partition the axis."""
    found: dict[tuple[str, int], set[tuple[int, ...]]] = defaultdict(set)
    reader: dict[tuple[str, int], list[str]] = defaultdict(list)
    tables: dict[str, tuple[str, NormSite]] = {}
    by_name = {s.name: s for s in layer}
    for site in layer:
        for k in planner.rec.norm_inputs[site.name]:
            rows = {tuple(r) for r in torch.unique(index[k].reshape(-1, index[k].shape[-1]), dim=0).tolist()}
            for source in feeds[k]:
                for w in writes[source]:
                    if w.table is not None:
                        full = tuple(range(planner.rec.tensors[w.param].shape[w.axis]))
                        if rows != {full}:
                            raise planner._fail(
                                site.name, f"{w.table} feeds it in a layout other than whole rows"
                            )
                        tables[w.param] = (w.table, by_name[w.table])
                        continue
                    found[(w.param, w.axis)] |= rows
                    reader[(w.param, w.axis)].append(site.name)
    groups: dict[tuple[str, int], list[torch.Tensor]] = {}
    axes: dict[str, int] = {}
    for (param, axis), rows in found.items():
        site = reader[(param, axis)][0]
        if param in tables:  # rewritten whole (``_table_rows``): may feed nothing but its norm
            if set(reader[(param, axis)]) != {tables[param][0]}:
                raise planner._fail(
                    site, f"{param} is normalized by {tables[param][0]} and also written into it"
                )
            continue
        if axes.setdefault(param, axis) != axis:
            raise planner._fail(site, f"{param} is written into normalized inputs along two axes")
        owner: dict[int, tuple[int, ...]] = {}
        for row in rows:
            if len(set(row)) != len(row) or any(owner.get(i, row) != row for i in row):
                raise planner._fail(site, f"{param} is normalized in overlapping groups of features")
            owner.update(dict.fromkeys(row, row))
        groups[(param, axis)] = [torch.tensor(sorted(r)) for r in sorted(rows)]
    return groups, tables


def _check_readers(planner: _Planner, cone: set[Key], index, feeds, groups, writes) -> None:
    """Every centered tensor must be read only by LayerNorms, sums, and views of itself.

    A view that holds none of the centered features (the v part of a fused qkv whose q part has a
    per-head LayerNorm) may be read by anything.
    """
    centered: dict[Key, torch.Tensor] = {}
    for source, ws in writes.items():
        w = ws[0]
        mask = torch.zeros(planner.rec.tensors[w.param].shape[w.axis], dtype=torch.bool)
        for g in groups.get((w.param, w.axis), [torch.arange(mask.numel())]):
            mask[g] = True
        centered[source] = mask
    for k in _in_order(planner.rec, cone):  # report the first offending read of the forward
        for use in planner.rec.uses.get(k, []):
            if isinstance(use, tuple):
                kind, site = use
                if kind == "output":
                    raise planner._fail(
                        _site_of(planner, k), "the stream it reads is also returned as a model output"
                    )
                if planner.kinds.get(site) != "layernorm":
                    raise planner._fail(
                        _site_of(planner, k),
                        f"the stream it reads is also read by {planner.kinds.get(site)} {site}, "
                        "which centering would change (never center what an RMSNorm reads)",
                    )
                continue
            if use.key in cone or use.op in _VALUE_FREE:
                continue
            if use.out is not None and use.op in _PASS and use.operands.get(0) == k:
                seen = _replay(use, index[k]).reshape(-1)
                if not any(bool(centered[s][seen].any()) for s in feeds[k]):
                    continue
            raise planner._fail(
                _site_of(planner, k),
                f"the stream it reads is also read by {planner._where(use)}, which centering would change",
            )


def _site_of(planner: _Planner, k: Key) -> str:
    """The first LayerNorm (in execution order) whose input depends on tensor ``k``."""
    for site, (cone, _) in planner.cones.items():
        if k in cone:
            return site
    return "?"


def _untie_plan(planner: _Planner, writes: dict[Key, list[_Write]], untie: bool) -> list[tuple[str, str]]:
    """Holders of each written parameter that must keep its original values: each gets its own copy.

    Every use of a written parameter (through views such as ``W.T``) must be one of its writes, or
    happen in a module that holds the parameter under another attribute (``lm_head`` tied to the
    embedding), which is then untied. Any other holder is untied too, so that only the writers see the
    centered values.
    """
    rec = planner.rec
    users: dict[str, set[int]] = defaultdict(set)
    first: dict[str, str] = {}
    for ws in writes.values():
        for w in ws:
            if w.table is None:
                users[w.param].add(id(w.user))
                first.setdefault(w.param, _site_of(planner, w.source))
    to_untie: list[tuple[str, str]] = []
    for param, writer_nodes in users.items():
        writer_modules, others = set(), []
        stack, seen = [(id(rec.tensors[param]), 0)], set()
        while stack:
            k = stack.pop()
            if k in seen:
                continue
            seen.add(k)
            for use in rec.uses.get(k, []):
                if isinstance(use, tuple):
                    others.append((use[0], use[1] or ""))
                elif id(use) in writer_nodes:
                    writer_modules.add(use.module)
                elif use.key is not None and planner.param_ref(use.key) is not None:
                    stack.append(use.key)  # a view of the parameter
                elif use.op not in _VALUE_FREE:
                    others.append((use.op, use.module))
        holders = [o for o in rec.owners[param] if o[0] not in writer_modules]
        for op, module in others:
            if not any(m == module for m, _ in holders):
                raise planner._fail(
                    first[param], f"{param} is written into it and also used by {op} in {module}"
                )
        if holders and not untie:
            raise planner._fail(first[param], f"{param} is written into it and shared with {holders[0][0]} "
                                "(untying disabled)")  # fmt: skip
        to_untie.extend(h for h in holders if h not in to_untie)
    return to_untie


def _bias_blocked(site: NormSite) -> bool:
    """The walker left the site unfolded only because some consumer has no bias (its last check)."""
    return site.bias is not None and not site.foldable and "no bias to absorb" in (site.reason or "")


def _bias_flags(model: nn.Module, walk: Walk, layer: list[NormSite]) -> tuple[list[_Flag], list[NormSite]]:
    """Config flags that add exactly the missing consumer biases, and the sites they make foldable."""
    blocked = [s for s in layer if _bias_blocked(s)]
    config = getattr(model, "config", None)
    if not blocked or config is None or not hasattr(config, "to_dict"):
        return [], []
    missing = {s.name: {c.module for c in s.consumers if c.bias is None} for s in blocked}
    candidates = [k for k, v in config.to_dict().items() if v is False and "bias" in k.lower()]
    valid = [f for f in (_flag_effect(model, name) for name in candidates) if f is not None and f.biases]
    covered = set().union(*(f.biases for f in valid)) if valid else set()
    resolved = [s for s in blocked if missing[s.name] <= covered]
    needed = set().union(*(missing[s.name] for s in resolved)) if resolved else set()
    flags = [f for f in valid if set(f.biases) & needed]
    return flags, resolved


def _flag_effect(model: nn.Module, flag: str) -> _Flag | None:
    """Build ``type(model)`` on the meta device with ``config.flag = True``: which biases appear?

    Returns None unless the flag only adds parameters named in modules that hold that name as ``None``
    (a module built to take a bias, e.g. ``nn.Linear(bias=False)``), module types unchanged.
    """
    config = copy.deepcopy(model.config)
    setattr(config, flag, True)
    try:
        with torch.device("meta"):
            other = type(model)(config)
    except Exception:  # noqa: BLE001 - a class that cannot be rebuilt this way offers no flag
        return None
    before = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    after = dict(other.named_parameters(remove_duplicate=False))
    if before - set(after):
        return None
    modules = dict(model.named_modules())
    added = {}
    for name in set(after) - before:
        mod_name, _, attr = name.rpartition(".")
        mod = modules.get(mod_name)
        if mod is None or type(mod) is not type(other.get_submodule(mod_name)):
            return None
        if attr not in mod._parameters or mod._parameters[attr] is not None:
            return None
        added[mod_name] = (attr, after[name].shape)
    return _Flag(flag, added)


def _centered(p: torch.Tensor, axis: int, groups: list[torch.Tensor]) -> torch.Tensor:
    """A new tensor: ``p`` with each index group along ``axis`` minus its mean (float64 arithmetic)."""
    out = p.detach().clone()
    if p.ndim == 1:
        blocks = [(None, 0, 1)]
    else:
        dim = 1 if axis == 0 else 0
        step = max(1, _CHUNK // max(1, p.numel() // p.shape[dim]))
        blocks = [(dim, s, min(step, p.shape[dim] - s)) for s in range(0, p.shape[dim], step)]
    for dim, start, length in blocks:
        view = out if dim is None else out.narrow(dim, start, length)
        block = view.double()
        for g in groups:
            g = g.to(block.device)
            part = block.index_select(axis, g)
            block.index_copy_(axis, g, part - part.mean(axis, keepdim=True))
        view.copy_(block.to(p.dtype))
    return out


def _table_rows(table: torch.Tensor, site: NormSite, norm: nn.Module) -> tuple[torch.Tensor, float]:
    """New rows ``E'`` and scale ``s`` with ``s * RMSNorm(E'[t]) == C LayerNorm(E[t])`` for every token.

    ``T = C LN(E)`` (rows centered) is what the stream must start from. With ``u = T / s`` and
    ``m = mean(u^2) < 1``, the row ``a * u`` with ``a = sqrt(eps / (1 - m))`` satisfies
    ``a * u / sqrt(a^2 m + eps) = u`` exactly, so an RMSNorm of weight ``s`` returns ``T``. ``s`` is the
    power of two at or above twice the largest row RMS of ``T`` (so ``m <= 1/4``), or 1 for a norm with
    no weight (whose rows already have ``m < 1``).
    """
    eps = site.eps
    w = getattr(norm, site.weight).detach().double() + site.offset if site.weight else None
    b = getattr(norm, site.bias).detach().double() if site.bias else None
    step = max(1, _CHUNK // table.shape[1])

    def target(rows: torch.Tensor) -> torch.Tensor:
        x = rows.double()
        n = (x - x.mean(-1, keepdim=True)) / torch.sqrt(x.var(-1, unbiased=False, keepdim=True) + eps)
        y = n * w if w is not None else n
        y = y + b if b is not None else y
        return y - y.mean(-1, keepdim=True)

    peak = 0.0
    for s in range(0, table.shape[0], step):
        peak = max(peak, target(table[s : s + step]).pow(2).mean(-1).max().item())
    scale = 2.0 ** math.ceil(math.log2(2 * math.sqrt(peak))) if w is not None and peak > 0 else 1.0
    out = torch.empty_like(table)
    for s in range(0, table.shape[0], step):
        u = target(table[s : s + step]) / scale
        m = u.pow(2).mean(-1, keepdim=True)
        if eps <= 0 or bool((m >= 1).any()):
            raise CenteringError(
                f"cannot rewrite the table read by {site.name}: eps {eps} leaves no exact row"
            )
        out[s : s + step] = (u * torch.sqrt(eps / (1 - m))).to(table.dtype)
    return out, scale


@torch.no_grad()
def _prepare(model: nn.Module, plan: _Plan) -> list[tuple]:
    """Allocate every new tensor; the model is not touched. Returns the actions ``_commit`` applies."""
    actions: list[tuple] = []
    for module, attr in plan.untie:
        old = model.get_submodule(module)._parameters[attr]
        actions.append(
            ("untie", (module, attr), nn.Parameter(old.detach().clone(), requires_grad=old.requires_grad))
        )
    for flag in plan.flags:
        for mod_name, (attr, shape) in flag.biases.items():
            ref = next(model.get_submodule(mod_name).parameters())
            zeros = nn.Parameter(torch.zeros(shape, dtype=ref.dtype, device=ref.device))
            actions.append(("bias", (mod_name, attr), zeros))
        actions.append(("flag", flag.name, True))
    for (param, axis), groups in plan.groups.items():
        actions.append(("copy", plan.tensors[param], _centered(plan.tensors[param], axis, groups)))
    for i, (emb, (norm_name, site)) in enumerate(plan.tables.items()):
        norm = model.get_submodule(norm_name)
        rows, scale = _table_rows(plan.tensors[emb], site, norm)
        actions.append(("copy", plan.tensors[emb], rows))
        if site.weight:
            w = getattr(norm, site.weight)
            actions.append(("copy", w, torch.full_like(w, scale - site.offset)))
        if site.bias:
            actions.append(("copy", getattr(norm, site.bias), torch.zeros_like(getattr(norm, site.bias))))
        plan.result.tables[i] += f" (constant scale {scale:g})"
    return actions


@torch.no_grad()
def _commit(model: nn.Module, walk: Walk, plan: _Plan, actions: list[tuple]) -> None:
    """Apply the prepared actions (assignments and same-shape copies) and update the walk's records."""
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    for kind, target, value in actions:
        if kind == "untie":
            module = model.get_submodule(target[0])
            shared = module._parameters[target[1]]
            name = next((n for n, holders in walk.owners.items() if target in holders), None)
            setattr(module, target[1], value)
            if name is not None:
                _retarget(walk, name, *target)
            if embedding is not None and getattr(embedding, "weight", None) is shared:
                untie_config(model)
        elif kind == "bias":
            model.get_submodule(target[0]).register_parameter(target[1], value)
        elif kind == "flag":
            setattr(model.config, target, value)
        else:
            target.copy_(value)
    for site in plan.resolved:
        for c in site.consumers:
            for flag in plan.flags:
                if c.bias is None and c.module in flag.biases:
                    c.bias = f"{c.module}.{flag.biases[c.module][0]}"
        site.foldable, site.reason = True, None
    tables = {norm for norm, _ in plan.tables.values()}
    for site in walk.sites:
        if site.name not in plan.result.sites:
            continue
        site.kind = "rmsnorm"
        if site.name in plan.result.kept_bias:
            site.reason = f"bias kept on the RMSNorm: {site.reason}, and no config setting adds one"
        if site.name in tables:
            site.reason = (
                "norm of an embedding lookup: the table was rewritten, the norm holds a constant scale"
            )


def _retarget(walk: Walk, shared: str, module: str, attr: str) -> None:
    """After ``module.attr`` got its own copy of ``shared``, point the walk's records at the new names."""
    mine = (module, attr)
    new = f"{module}.{attr}" if module else attr
    rest = [o for o in walk.owners.pop(shared, []) if o != mine]
    rest_name = shared if shared != new else (f"{rest[0][0]}.{rest[0][1]}" if rest else shared)
    uses = walk.param_uses.pop(shared, [])
    walk.owners[new] = [mine]
    walk.param_uses[new] = [u for u in uses if u[1] == module]
    if rest:
        walk.owners[rest_name] = rest
        walk.param_uses[rest_name] = [u for u in uses if u[1] != module]
    for site in walk.sites:
        for c in site.consumers:
            if c.param == shared:
                c.param = new if c.module == module else rest_name
            if c.bias == shared:
                c.bias = new if c.module == module else rest_name


def center(
    model: nn.Module,
    walk: Walk,
    input_ids: torch.Tensor | None = None,
    *,
    untie: bool = True,
    add_biases: bool = True,
) -> CenterResult:
    """Make every LayerNorm input of ``model`` zero-mean without changing its function, in place.

    Afterwards each LayerNorm site of ``walk`` has ``kind == "rmsnorm"`` (it computes the same as an
    RMSNorm with its weight and bias), biases that config flags can carry are added and recorded on the
    consumers (so ``fold`` absorbs the norm's bias), and shared parameters are untied in the walk's
    records; ``fold`` and ``swap.swap_norms`` then finish the conversion. A model without LayerNorm is
    left alone (``result.note``).

    Args:
        model: a Hugging Face model (any module whose forward takes ``input_ids``), float parameters.
        walk: ``normswap.walk.walk(model, input_ids)`` of the same model, not yet folded.
        input_ids: ``(batch, seq)`` int64 ids for the recording forward; default as ``walk``.
        untie: allow giving a holder of a written parameter (``lm_head`` tied to the embedding) its own
            copy; with False such a model is refused.
        add_biases: allow setting config flags that add zero biases to consumers.

    Returns:
        A ``CenterResult``.

    Raises:
        CenteringError: conversion would not be exact (post-LN model, positions from a buffer, a
            non-linear producer, a stream also read by an RMSNorm or returned, untying disabled); the
            model is unchanged. Any other error before the commit also leaves it unchanged.
    """
    plan = plan_centering(model, walk, input_ids, untie=untie, add_biases=add_biases)
    if plan.result.note is None:
        actions = _prepare(model, plan)
        _commit(model, walk, plan, actions)
    return plan.result


class BiasedRMSNorm(FusedRMSNorm):
    """``FusedRMSNorm`` plus an additive bias: a centered LayerNorm that keeps its bias parameter.

    ``y = x * rsqrt(mean(x**2) + eps) * (offset + weight) + bias`` over the last axis. Cast order
    ``"fp32"`` (``nn.LayerNorm``'s): ``y = (n * (offset + w).float() + b.float()).to(x.dtype)``, one
    rounding; ``"llama"``: ``y = (offset + w) * n.to(x.dtype) + b``. Keeping the bias (zero once folded)
    keeps the original LayerNorm's state-dict keys, so a saved checkpoint is in the model's own format.

    Args:
        shape, eps, offset, cast_order, weight_name, device, dtype, backend: as ``FusedRMSNorm``.
        bias_name: attribute name of the bias parameter (``shape``, initialized to 0).

    Forward: ``x`` of shape ``(..., D)`` -> same shape and dtype as ``FusedRMSNorm``'s.
    """

    def __init__(self, shape, eps: float, offset: float = 0.0, cast_order: str = "fp32",
                 weight_name: str | None = "weight", bias_name: str = "bias", device=None, dtype=None,
                 backend: str | None = None) -> None:  # fmt: skip
        super().__init__(shape, eps, offset, cast_order, weight_name, device, dtype, backend)
        self.bias_name = bias_name
        self.register_parameter(bias_name, nn.Parameter(torch.zeros(self.shape, device=device, dtype=dtype)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, b = self._params()
        if self.cast_order == "llama":
            return rms_norm(x, w, self.eps, self.offset, "llama", self.backend) + b
        compute = torch.promote_types(x.dtype, torch.float32)
        y = rms_norm(
            x.to(compute), None if w is None else w.to(compute), self.eps, self.offset, "fp32", self.backend
        )
        return (y + b.to(compute)).to(x.dtype)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", bias_name={self.bias_name!r}"
