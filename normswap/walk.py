"""One traced forward pass: find every norm and the linear ops that consume its output.

During a single short forward (2 x 16 token ids by default):

* temporary global module hooks keep the stack of executing modules and record, for every call of a leaf
  module with one tensor input and an output of the same shape, the input shape; that output becomes a
  *source* whose uses are followed;
* a ``TorchFunctionMode`` sees every torch function call. Tensors derived from a source through shape-only
  and value-preserving ops (view, reshape, transpose, slicing of leading axes, dropout in eval, casts, scalar
  multiples) stay tagged with a dim map (``dimmap.py``) that says where the source's feature axis went.
  Tensors derived from parameters are tagged the same way, so an op that contracts the feature axis with a
  parameter's axis (``F.linear``, ``matmul``/``addmm`` as in GPT-2's Conv1D and Falcon, ``_grouped_mm`` as in
  transformers 5's stacked MoE experts) is recorded as a *consumer* of that parameter along that axis. Plain
  matrix products are read both ways (``x @ W`` and ``W @ x``, as transformers' batched experts do); a
  parameter added to a consumer's result, directly or after a reshape (Falcon's ``x @ W.T + b``,
  ``bmm(...).squeeze(-1).add_(b)``), is that consumer's bias. Ops that read only a shape or dtype
  (``zeros_like``, ``x.type_as(norm_out)``) are not uses. Any other use (a residual add, RoPE, attention
  scores, an activation, a model output) is recorded with the op and module that made it.
* after the forward, a module that never ran but has an interchangeable sibling that received a norm's output
  (a routed expert that got no token) is run once on that sibling's inputs, so its consumers are seen too.

Per-channel affine modules (BatchNorm in eval mode, NoNorm: ``normswap.affine``) are sources too, one per axis
of their input as long as their tensors (the probe keeps the axis they act on). A convolution
(``F.conv1d/2d/3d``) whose input channels are that axis is a consumer (``groups`` and zero padding
recorded; reflect / replicate / circular ``pad`` is followed); and the output of every linear map or
convolution on a parameter is remembered, with every op that uses it (weakly: no activation is kept alive),
so that such a module's input can be traced back to the op that produced it, its fold target when nothing
else reads it. A norm (RMSNorm, LayerNorm) never folds into a convolution: for it a convolution is a use
like any other.

After the forward the hooks are removed, the module modes restored, and the sources are probed
(``probe.py``); only those that behave as norms become ``NormSite``s. A norm is foldable when every use of
its output is a consumer, its scale is one value per feature, (for a bias) every consumer adds a bias, and
no parameter that the trace never used sits next to one of its consumers (``_guard_untouched``).

No per-architecture special case lives here; everything is decided by the ops seen and the module tree.
"""

from __future__ import annotations

import inspect
import logging
import weakref
from collections import defaultdict
from dataclasses import dataclass, field, replace

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from normswap import dimmap
from normswap.affine import affine_foldability, channel_axes, channels, probe_affine
from normswap.device import exact_float32, model_device, refuse_offloaded
from normswap.probe import ProbeError, is_candidate, nonfinite_tensors, probe_module
from normswap.reads import read_names, tie_configs
from normswap.recording import Recorder
from normswap.sites import AFFINE_KINDS, Consumer, NormSite

log = logging.getLogger("normswap")

_LINEAR_OPS = {"linear", "matmul", "__matmul__", "mm", "bmm", "addmm", "baddbmm", "_grouped_mm", "grouped_mm",
               "grouped_mm_fallback"}  # fmt: skip
_ADD_OPS = {"add", "add_", "__add__", "__iadd__", "__radd__"}
_SCALAR_OPS = {"mul", "__mul__", "__rmul__", "div", "__truediv__", "neg", "__neg__"}
_IGNORED = {"size", "dim", "numel", "stride", "data_ptr", "is_floating_point", "is_contiguous", "__len__",
            "element_size", "storage_offset", "get_device", "is_complex", "__format__", "__repr__",
            "__hash__", "untyped_storage", "shape", "dtype", "device", "ndim", "grad_fn", "is_cuda",
            "requires_grad", "is_leaf", "layout", "grad", "is_meta", "is_sparse", "is_quantized", "itemsize",
            "nbytes", "names", "is_mps", "is_xpu", "__get__",
            # ops that read only the shape, dtype or device of a tensor, never its values
            "zeros_like", "ones_like", "empty_like", "full_like", "rand_like", "randn_like", "randint_like",
            "new_zeros", "new_ones", "new_empty", "new_full", "_has_compatible_shallow_copy_type",
            "__set__"}  # fmt: skip
# Ops whose tensor arguments after the first donate only a dtype or shape (``x.type_as(other)``).
_DONOR_OPS = {"type_as", "to", "view_as", "reshape_as", "expand_as"}
_MATMUL_OPS = {"matmul", "__matmul__", "mm", "bmm"}
_CONV_OPS = {"conv1d": 1, "conv2d": 2, "conv3d": 3}  # F.conv*d -> number of spatial axes
_PRODUCER_OPS = {"linear", *_CONV_OPS}  # ops whose output may be folded into backwards (AFFINE_KINDS)


def _quantized(stored: torch.dtype, used: torch.dtype) -> bool:
    """Whether a weight stored as ``stored`` and reaching a linear op as ``used`` is dequantized in the
    forward (an integer weight, or a float weight of fewer bits upcast): its storage cannot hold a fold's
    result without re-rounding it."""
    return not stored.is_floating_point or stored.itemsize < used.itemsize


def _func_name(func) -> str:
    name = getattr(func, "__name__", None) or type(func).__name__
    if name == "__get__":  # a Tensor property: Tensor.T, Tensor.shape, ...
        owner = getattr(func, "__self__", None)
        name = getattr(owner, "__name__", name)
    if hasattr(func, "_schema"):  # torch.ops.ns.op.overload
        name = str(func._schema.name).split("::")[-1]
    return name


@dataclass
class _Tag:
    source: int  # index into Walk.calls
    dims: dimmap.DimMap  # dims of this tensor -> axes of the source output
    base_ndim: int
    feature: int | None = None  # the source output's feature axis: its last (norms) or its channel axis

    def feature_axis(self) -> int | None:
        feature = self.base_ndim - 1 if self.feature is None else self.feature
        for i, d in enumerate(self.dims):
            if d == feature:
                return i
        return None


@dataclass
class _PRef:
    param: str  # qualified parameter name
    dims: dimmap.DimMap


@dataclass
class Use:
    """One use of a source's output seen in the trace: a consumer, or the reason it is not one."""

    op: str
    module: str
    consumer: Consumer | None = None
    reason: str | None = None


@dataclass
class _Produced:
    """The output of a linear map or convolution on a parameter (``_PRODUCER_OPS``), and every op that used
    it: a per-channel affine module whose input it is may fold into the op when the module is its only
    user. Held by a weak reference: the tracer keeps no activation alive for it."""

    ref: weakref.ref
    producer: Consumer  # ``axis``: the weight's axis that gives the output channels
    channel: int  # the output's channel axis
    uses: list[tuple[str, str]] = field(default_factory=list)  # (op, module executing it)


@dataclass
class SourceCall:
    module: str
    input_shape: tuple[int, ...]
    uses: list[Use] = field(default_factory=list)
    input_dtype: torch.dtype | None = None  # the probe measures eps and cast order in it
    extra: str | None = None  # the other inputs of a call that was not a one-input call, described
    feature: int | None = None  # the axis followed: None for a norm candidate (the last), else a channel axis
    producers: list[_Produced | None] = field(default_factory=list)  # per call: what made its input
    makers: list[str] = field(default_factory=list)  # per call: the op that made its input, described


def _other_inputs(args: tuple, kwargs: dict, x: torch.Tensor) -> str | None:
    """Describe the inputs of a module call other than its one tensor ``x``, or None when there are none.

    Keyword arguments that are None do not count (``norm(x, gate=None)`` is a one-input call); any other
    argument, tensor or not, might change what the module computes, and the probe calls it on ``x`` alone.
    """
    others = [f"positional argument {i}" for i, a in enumerate(args) if a is not x]
    others += [f"{k}=" for k, v in kwargs.items() if v is not None and v is not x]
    return ", ".join(others) if others else None


@dataclass
class Walk:
    """What one traced forward saw.

    Attributes:
        sites: the norms found, in execution order, with consumers and foldability.
        param_uses: for each parameter name, the (op, module) pairs that used it in the trace.
        owners: for each parameter name, every ``(module_name, attribute)`` holding that Parameter object.
        untouched: names of 2-D+ parameters no op used (e.g. experts that got no tokens); a fold never
            depends on them, but a consumer hidden among them would not be seen.
        probe_failures: norm candidates whose probe failed unexpectedly: module name -> error (each also
            logged as a warning); such a module may be a norm that is left out of ``sites``.
        config_reads: attribute names the traced forward read on the config objects untying would change
            (``normswap.reads``); None when not recorded.
        other_uses: for each site name, why each use of its output that is not a consumer is not one (the
            ``reason`` of the walk's non-consumer uses, e.g. ``"is returned as a model output"``); a site
            whose output only feeds consumers has none. ``normswap.rotate`` reads it.
        recording: the graph of the same forward (``walk(..., record=True)``), or None; ``take_recording``
            hands it over.
    """

    sites: list[NormSite]
    param_uses: dict[str, list[tuple[str, str]]]
    owners: dict[str, list[tuple[str, str]]]
    untouched: list[str]
    probe_failures: dict[str, str] = field(default_factory=dict)
    config_reads: frozenset[str] | None = None
    other_uses: dict[str, list[str]] = field(default_factory=dict)
    recording: Recorder | None = field(default=None, repr=False)

    def take_recording(self) -> Recorder | None:
        """``recording``, which this walk then no longer holds (the caller frees its tensors)."""
        recording, self.recording = self.recording, None
        return recording


class _Tracer(TorchFunctionMode):
    def __init__(self, model: nn.Module, record: bool = False):
        super().__init__()
        self.names = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
        self.param_names: dict[int, str] = {}
        self.owners: dict[str, list[tuple[str, str]]] = defaultdict(list)
        for mod_name, mod in model.named_modules(remove_duplicate=False):
            for attr, p in mod._parameters.items():
                if p is None:
                    continue
                qual = self.param_names.setdefault(id(p), f"{mod_name}.{attr}" if mod_name else attr)
                if (mod_name, attr) not in self.owners[qual]:
                    self.owners[qual].append((mod_name, attr))
        self.params: dict[str, torch.Tensor] = {self.param_names[id(p)]: p for p in model.parameters()}
        self.pref: dict[int, _PRef] = {
            id(p): _PRef(self.param_names[id(p)], dimmap.identity(p.ndim)) for p in model.parameters()
        }
        self.tags: dict[int, list[_Tag]] = {}
        self.keep: list[torch.Tensor] = []  # holds tagged tensors alive so ids are not reused
        self.calls: list[SourceCall] = []
        self.call_of: dict[int, int] = {}  # id(module) -> index of first call (one site per module)
        self.stack: list[str] = []
        self.param_uses: dict[str, list[tuple[str, str]]] = defaultdict(list)
        self.results: dict[int, list[Use]] = {}  # id(op output) -> the consumer uses that produced it
        self.module_of_call: list[nn.Module] = []
        self.called: set[int] = set()  # id of every module the forward ran
        self.first_args: dict[int, tuple] = {}  # id(module) -> (args, kwargs) of its first call, if tagged
        self.finished: set[int] = set()  # id of every module whose first call has returned
        self.config_reads: set[str] = set()  # attribute names the forward read on the tie configs
        self.affine_of: dict[tuple[int, int], int] = {}  # (id(module), channel axis) -> index of its source
        self.produced: dict[int, _Produced] = {}  # id(linear/conv output) -> what made it and its uses
        self.made_by: dict[int, tuple[weakref.ref, str]] = {}  # id(op output) -> the op, described
        self._made_limit = 4096  # purge dead entries of made_by when it grows past this
        self.recorder = None  # the graph of the forward, for centering and the rotation (``recording``)
        if record:
            modules = {n: id(m) for n, m in model.named_modules(remove_duplicate=False)}
            buffers = {id(b): n for n, b in model.named_buffers(remove_duplicate=False)}
            self.recorder = Recorder(self.param_names, self.params, self.owners, buffers, modules)

    # -- module hooks -------------------------------------------------------------------------------------
    def pre_hook(self, module, args):
        # a module outside the model's tree (a function the ``kernels`` package wraps as a module, as
        # transformers >= 5.25 does with its rotary embedding) runs on behalf of the module that called it
        name = self.names.get(id(module))
        if name is None:
            name = self.stack[-1] if self.stack else type(module).__name__
        self.stack.append(name)
        self.called.add(id(module))
        if self.recorder is not None:
            self.recorder.call(module, args)

    def replay_idle_siblings(self, model: nn.Module) -> None:
        """Run, once, every module the forward never called whose sibling (same parent, same class, same
        parameter names and shapes) was called with a norm's output: on the sibling's first inputs.

        Routed experts that received no token in the trace are interchangeable with those that did, and would
        read the same norm output on other inputs; replaying one shows its consumers by the same dataflow.
        Only modules whose recorded inputs carry a norm's output are replayed, so nothing that merely sits
        idle (an unused head, a skipped layer) runs. What a replayed module returns is discarded.
        """
        for parent in model.modules():
            children = list(parent.children())
            called = [c for c in children if id(c) in self.first_args]
            for child in children:
                if id(child) in self.called or not any(True for _ in child.parameters()):
                    continue
                signature = [(n, p.shape) for n, p in child.named_parameters()]
                twin = next(
                    (c for c in called if type(c) is type(child)
                     and [(n, p.shape) for n, p in c.named_parameters()] == signature),
                    None,
                )  # fmt: skip
                if twin is None:
                    continue
                args, kwargs = self.first_args[id(twin)]
                saved, recorder, self.recorder = list(self.stack), self.recorder, None  # not in the graph
                try:
                    child(*args, **kwargs)
                except Exception:  # noqa: BLE001 - a sibling that cannot be replayed stays "untouched"
                    pass
                self.stack, self.recorder = saved, recorder

    def post_hook(self, module, args, kwargs, output):
        if self.stack:
            self.stack.pop()
        if self.recorder is not None:
            self.recorder.returned(output)
        if id(module) not in self.finished:
            self.finished.add(id(module))
            # inputs carrying a norm's output are kept for replay_idle_siblings (already alive: self.keep)
            flat = tree_flatten((args, kwargs))[0]
            if any(isinstance(a, torch.Tensor) and id(a) in self.tags for a in flat):
                self.first_args[id(module)] = (args, kwargs)
        if id(module) not in self.names or self.names[id(module)] == "":
            return
        leaves = [*args, *kwargs.values()]
        x = next((a for a in leaves if isinstance(a, torch.Tensor)), None)
        if x is None or not isinstance(output, torch.Tensor):
            return
        if not x.is_floating_point() or output.shape != x.shape or x.ndim < 1:
            return
        indices = self._sources(module, tuple(x.shape), x.dtype)
        if not indices:
            return
        produced = self.produced.get(id(x))
        made = self.made_by.get(id(x))
        maker = made[1] if made is not None and made[0]() is x else "the model's input"
        for index in indices:  # what made this call's input (a per-channel map may fold into it)
            self.calls[index].producers.append(produced if produced and produced.ref() is x else None)
            self.calls[index].makers.append(maker)
        extra = _other_inputs(args, kwargs, x)
        if extra is not None:  # a gated norm, a norm given its residual: not a one-input map
            where = f" by {self._module()}" if self._module() else ""
            for index in indices:
                self.calls[index].extra = self.calls[index].extra or f"{extra}{where}"
            return
        for index in indices:
            tag = _Tag(index, dimmap.identity(output.ndim), output.ndim, self.calls[index].feature)
            self._tag(output, tag)

    def _sources(self, module: nn.Module, shape: tuple[int, ...], dtype: torch.dtype) -> list[int]:
        """The sources (indices into ``calls``) a call of ``module`` on an input of ``shape`` feeds: one for
        a norm candidate (its last axis followed), one per other axis it might act on per channel
        (``normswap.affine.channel_axes``); the probe later keeps the one that is what the module does."""
        indices = []
        norm = is_candidate(module, shape)
        if norm:
            index = self.call_of.get(id(module))
            if index is None:
                index = self.call_of[id(module)] = len(self.calls)
                self.calls.append(SourceCall(self.names[id(module)], shape, input_dtype=dtype))
                self.module_of_call.append(module)
            indices.append(index)
        for axis in channel_axes(module, shape):
            if norm and axis == len(shape) - 1:
                continue  # the norm candidate's source follows that axis already
            index = self.affine_of.get((id(module), axis))
            if index is None:
                index = self.affine_of[(id(module), axis)] = len(self.calls)
                self.calls.append(SourceCall(self.names[id(module)], shape, input_dtype=dtype, feature=axis))
                self.module_of_call.append(module)
            indices.append(index)
        return indices

    # -- tagging ------------------------------------------------------------------------------------------
    def _tag(self, t: torch.Tensor, tag: _Tag) -> None:
        tags = self.tags.setdefault(id(t), [])
        if tag not in tags:
            tags.append(tag)
        self.keep.append(t)

    def _module(self) -> str:
        return self.stack[-1] if self.stack else ""

    def _use(self, tag: _Tag, op: str, reason: str | None = None, consumer: Consumer | None = None) -> Use:
        use = Use(op, self._module(), consumer, reason)
        self.calls[tag.source].uses.append(use)
        return use

    def _nonlinear(self, tags: list[_Tag], op: str, why: str | None = None) -> None:
        where = f" in {self._module()}" if self._module() else ""
        for tag in tags:
            self._use(tag, op, reason=why or f"feeds {op}{where}")

    # -- the mode -----------------------------------------------------------------------------------------
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = _func_name(func)
        if self.recorder is not None:
            self.recorder.op(func, name, args, kwargs, out, self._module(), name in _IGNORED)
        if name in _IGNORED:
            return out
        flat, _ = tree_flatten((args[:1], {}) if name in _DONOR_OPS else (args, kwargs))
        tensors = [a for a in flat if isinstance(a, torch.Tensor)]
        for a in tensors:
            produced = self.produced.get(id(a))
            if produced is not None and produced.ref() is a:
                produced.uses.append((name, self._module()))
        if name in _PRODUCER_OPS:
            self._record_producer(name, args, kwargs, out)
        if isinstance(out, torch.Tensor):
            self._made(out, name)
        tagged = [(a, self.tags[id(a)]) for a in tensors if id(a) in self.tags]
        prefs = [(a, self.pref[id(a)]) for a in tensors if id(a) in self.pref]
        if not tagged and not prefs:
            if tensors and id(tensors[0]) in self.results and name in dimmap.SAME_SHAPE | dimmap.RESHAPE:
                self._keep_result(self.results[id(tensors[0])], out)  # e.g. bmm(...).squeeze(-1)
            return out
        if name in _LINEAR_OPS:
            self._linear(name, args, kwargs, out)
        elif name in _CONV_OPS:
            self._conv(name, args, kwargs)
        elif name in _ADD_OPS and not tagged and self._is_result_plus_param(args):
            self._bias(args, out)
        elif self._propagate(name, args, kwargs, out, tagged, prefs):
            pass
        else:
            for _, tags in tagged:
                self._nonlinear(tags, name)
            for _, ref in prefs:
                self.param_uses[ref.param].append((name, self._module()))
        return out

    def _propagate(self, name, args, kwargs, out, tagged, prefs) -> bool:
        """Follow shape-only, value-preserving ops; True when handled."""
        if not args or not isinstance(args[0], torch.Tensor):
            return False
        src = args[0]
        if id(src) not in self.tags and id(src) not in self.pref:
            return False
        if any(id(a) in self.tags for a, _ in tagged if a is not src):
            return False  # two tagged operands: a real combination of values
        if name in dimmap.SAME_SHAPE or name in _SCALAR_OPS:
            if name in _SCALAR_OPS and any(isinstance(a, torch.Tensor) and a.ndim > 0 for a in args[1:]):
                return False
            if name.startswith("dropout") or name.endswith("dropout"):
                if kwargs.get("training", args[2] if len(args) > 2 else True) and (
                    kwargs.get("p", args[1] if len(args) > 1 else 0.5) > 0
                ):
                    return False
            if isinstance(out, torch.Tensor) and out.shape == src.shape:
                return self._derive(src, out, lambda d: d)
            return False
        if name == "pad":  # reflect / replicate / circular padding copies values: every per-channel map
            mode = kwargs.get("mode", args[2] if len(args) > 2 else "constant")  # commutes with it
            pad = args[1] if len(args) > 1 else kwargs.get("pad")
            if mode == "constant" or not isinstance(out, torch.Tensor) or pad is None:
                return False
            padded = {src.ndim - 1 - i // 2 for i, p in enumerate(pad) if p}
            return self._derive(
                src, out, lambda d: tuple(None if i in padded else v for i, v in enumerate(d))
            )
        if name in dimmap.RESHAPE or name == "expand" or name == "expand_as":
            if not isinstance(out, torch.Tensor):
                return False
            if name in ("expand", "expand_as"):
                lead = out.ndim - src.ndim
                return self._derive(
                    src,
                    out,
                    lambda d: (
                        (None,) * lead
                        + tuple(
                            d[i] if src.shape[i] == out.shape[lead + i] else None for i in range(src.ndim)
                        )
                    ),
                )
            return self._derive(src, out, lambda d: dimmap.after_reshape(d, src.shape, out.shape))
        if name in dimmap.TRANSPOSE:
            if name in ("t", "T", "mT") or (name in ("transpose", "swapaxes", "swapdims")):
                if name in ("t", "T"):
                    a, b = 0, src.ndim - 1
                elif name == "mT":
                    a, b = src.ndim - 2, src.ndim - 1
                else:
                    a, b = (kwargs.get("dim0", args[1] if len(args) > 1 else None),
                            kwargs.get("dim1", args[2] if len(args) > 2 else None))  # fmt: skip
                a, b = a % src.ndim, b % src.ndim
                return self._derive(src, out, lambda d: dimmap.after_transpose(d, a, b))
            order = args[1:] if len(args) > 2 else (args[1] if len(args) > 1 else kwargs.get("dims"))
            order = [o % src.ndim for o in order]
            return self._derive(src, out, lambda d: dimmap.after_permute(d, order))
        if name == "__getitem__":
            return self._derive(src, out, lambda d: dimmap.after_getitem(d, src.shape, args[1]))
        if name == "repeat_interleave":  # copies along one axis; dim=None flattens (not followed)
            dim = kwargs.get("dim", args[2] if len(args) > 2 else None)
            if dim is None:
                return False
            dim %= src.ndim
            return self._derive(src, out, lambda d: tuple(None if i == dim else v for i, v in enumerate(d)))
        if name == "index_select":
            dim = (kwargs.get("dim", args[1])) % src.ndim
            return self._derive(src, out, lambda d: tuple(None if i == dim else v for i, v in enumerate(d)))
        if name in dimmap.SPLIT and isinstance(out, tuple | list):
            dim = kwargs.get("dim", args[2] if len(args) > 2 else 0) % src.ndim
            for piece in out:
                if name == "unbind":
                    self._derive(src, piece, lambda d: tuple(v for i, v in enumerate(d) if i != dim))
                else:
                    self._derive(
                        src, piece, lambda d: tuple(None if i == dim else v for i, v in enumerate(d))
                    )
            return True
        return False

    def _derive(self, src, out, fn) -> bool:
        if not isinstance(out, torch.Tensor):
            return False
        if id(src) in self.pref:
            ref = self.pref[id(src)]
            dims = fn(ref.dims)
            if dims is None or len(dims) != out.ndim:
                return False
            if id(out) not in self.pref:  # forgotten when it dies (not kept alive: a weight's view costs
                weakref.finalize(out, self.pref.pop, id(out), None)  # nothing, a streamed expert's row does)
            self.pref[id(out)] = _PRef(ref.param, dims)
            return True
        for tag in self.tags[id(src)]:
            dims = fn(tag.dims)
            if (
                dims is None
                or len(dims) != out.ndim
                or _Tag(tag.source, dims, tag.base_ndim, tag.feature).feature_axis() is None
            ):
                self._nonlinear(
                    [tag], "reshape", f"is reshaped or sliced across its feature axis in {self._module()}"
                )
                continue
            self._tag(out, _Tag(tag.source, dims, tag.base_ndim, tag.feature))
        return True

    def _linear(self, name, args, kwargs, out) -> None:
        if name in ("addmm", "baddbmm"):
            bias, left, right = args[0], args[1], args[2]
            if kwargs.get("beta", 1) != 1 or kwargs.get("alpha", 1) != 1:
                bias = None
        elif name == "linear":
            left, right = args[0], (args[1] if len(args) > 1 else kwargs["weight"])
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            right_axis = right.ndim - 1  # F.linear contracts x[..., k] with weight[:, k]
        else:
            left, right = args[0], (args[1] if len(args) > 1 else kwargs.get("other", kwargs.get("mat2")))
            bias = None
        if name != "linear":
            right_axis = right.ndim - 2 if right.ndim >= 2 else 0
        # (activation, its contracted axis, weight, the weight's contracted axis): x @ W, and for plain
        # matrix products also W @ x (transformers' batched experts run bmm(weight, x.unsqueeze(-1))).
        pairs = [(left, left.ndim - 1, right, right_axis)]
        if name in _MATMUL_OPS and right.ndim >= 2:
            pairs.append((right, right.ndim - 2, left, left.ndim - 1))
        elif id(right) in self.tags:
            self._nonlinear(self.tags[id(right)], name, f"is the right operand of {name} in {self._module()}")
        consumers = []
        for ref in {
            self.pref[id(t)].param: self.pref[id(t)] for t in (left, right) if id(t) in self.pref
        }.values():
            self.param_uses[ref.param].append((name, self._module()))
        for act, act_axis, weight, w_axis in pairs:
            tags = self.tags.get(id(act), [])
            ref = self.pref.get(id(weight))
            for tag in tags:
                if ref is None:
                    self._nonlinear(
                        [tag], name, f"is multiplied by an activation ({name}) in {self._module()}"
                    )
                    continue
                base_axis = ref.dims[w_axis] if w_axis < len(ref.dims) else None
                if tag.feature_axis() != act_axis or base_axis is None:
                    self._nonlinear([tag], name, f"feeds {name} along another axis in {self._module()}")
                    continue
                stored = self.params[ref.param].dtype
                if _quantized(stored, weight.dtype):
                    module = self._consumer_module(ref.param)
                    used = str(weight.dtype).removeprefix("torch.")
                    self._nonlinear([tag], name, (
                        f"feeds the quantized consumer {module} (weight {ref.param} stored as "
                        f"{str(stored).removeprefix('torch.')}, used as {used}): a fold would re-round it"
                    ))  # fmt: skip
                    continue
                bias_ref = self.pref.get(id(bias)) if isinstance(bias, torch.Tensor) else None
                consumer = Consumer(
                    module=self._consumer_module(ref.param),
                    param=ref.param,
                    op=name,
                    axis=base_axis,
                    bias=bias_ref.param if bias_ref else None,
                )
                consumers.append(self._use(tag, name, consumer=consumer))
        if isinstance(bias, torch.Tensor) and id(bias) in self.pref:
            self.param_uses[self.pref[id(bias)].param].append((name, self._module()))
        if consumers:
            self._keep_result(consumers, out)

    def _conv(self, name, args, kwargs) -> None:
        """``F.conv1d/2d/3d(input, weight, bias, stride, padding, dilation, groups)``: a consumer of a source
        whose feature axis is the input's channel axis, the weight's axis 1 (``in / groups``) contracted
        with it. ``zero_pad``: the op pads the input with zeros (``padding`` > 0, or ``"same"`` with a kernel
        longer than 1), so a shift of its input would not reach the border."""
        x = args[0]
        weight = args[1] if len(args) > 1 else kwargs.get("weight")
        bias = args[2] if len(args) > 2 else kwargs.get("bias")
        padding = args[4] if len(args) > 4 else kwargs.get("padding", 0)
        groups = args[6] if len(args) > 6 else kwargs.get("groups", 1)
        for t in (weight, bias):
            if isinstance(t, torch.Tensor) and id(t) in self.pref:
                self.param_uses[self.pref[id(t)].param].append((name, self._module()))
        tags = self.tags.get(id(x), []) if isinstance(x, torch.Tensor) else []
        ref = self.pref.get(id(weight)) if isinstance(weight, torch.Tensor) else None
        where = f" in {self._module()}"
        for tag in tags:
            if ref is None or ref.dims != dimmap.identity(weight.ndim):
                self._nonlinear([tag], name, f"is convolved with a computed kernel ({name}){where}")
                continue
            if tag.feature_axis() != x.ndim - _CONV_OPS[name] - 1:
                self._nonlinear([tag], name, f"feeds {name} along another axis{where}")
                continue
            stored = self.params[ref.param].dtype
            if _quantized(stored, weight.dtype):
                module = self._consumer_module(ref.param)
                self._nonlinear(
                    [tag], name, f"feeds the quantized consumer {module}: a fold would re-round it"
                )
                continue
            if isinstance(padding, str):
                zero_pad = padding == "same" and any(k > 1 for k in weight.shape[2:])
            else:
                zero_pad = any(p != 0 for p in (padding if isinstance(padding, tuple | list) else (padding,)))
            bias_ref = self.pref.get(id(bias)) if isinstance(bias, torch.Tensor) else None
            consumer = Consumer(
                module=self._consumer_module(ref.param), param=ref.param, op=name, axis=1,
                bias=bias_ref.param if bias_ref else None, groups=int(groups), zero_pad=zero_pad,
            )  # fmt: skip
            self._use(tag, name, consumer=consumer)

    def _made(self, out: torch.Tensor, name: str) -> None:
        """Remember which op made ``out`` (for the reason a per-channel map cannot fold into its input's
        producer); entries of dead tensors are dropped as the map grows, so it holds about the live ones."""
        self.made_by[id(out)] = (weakref.ref(out), f"{name} in {self._module()}" if self._module() else name)
        if len(self.made_by) > self._made_limit:
            self.made_by = {k: v for k, v in self.made_by.items() if v[0]() is not None}
            self._made_limit = 2 * len(self.made_by) + 4096

    def _record_producer(self, name, args, kwargs, out) -> None:
        """Remember ``out`` of a linear map or convolution whose weight (and bias) are parameters used
        whole: a per-channel affine module fed by ``out`` alone may fold into it (``_Produced``)."""
        weight = args[1] if len(args) > 1 else kwargs.get("weight")
        bias = args[2] if len(args) > 2 else kwargs.get("bias")
        ref = self.pref.get(id(weight)) if isinstance(weight, torch.Tensor) else None
        if ref is None or not isinstance(out, torch.Tensor) or out.ndim < 1:
            return
        if name == "linear":  # y[..., o] = sum_k x[..., k] w[o, k]: the weight's axis 0 gives the channels
            axis, channel = (ref.dims[0] if weight.ndim == 2 else None), out.ndim - 1
        else:  # y[:, o, ...]: the weight's axis 0 (out channels); unbatched inputs have no batch axis
            axis = 0 if ref.dims == dimmap.identity(weight.ndim) else None
            channel = out.ndim - _CONV_OPS[name] - 1
        bias_ref = self.pref.get(id(bias)) if isinstance(bias, torch.Tensor) else None
        if axis is None or (bias is not None and (bias_ref is None or bias_ref.dims != (0,))):
            return
        stored = self.params[ref.param].dtype
        if _quantized(stored, weight.dtype):
            return
        producer = Consumer(
            module=self._consumer_module(ref.param), param=ref.param, op=name, axis=axis,
            bias=bias_ref.param if bias_ref else None,
        )  # fmt: skip
        self.produced[id(out)] = _Produced(weakref.ref(out), producer, channel)

    def _keep_result(self, consumers: list[Use], out) -> None:
        if isinstance(out, torch.Tensor):
            self.results[id(out)] = consumers
            self.keep.append(out)

    def _is_result_plus_param(self, args) -> bool:
        pair = [a for a in args[:2] if isinstance(a, torch.Tensor)]
        return (
            len(pair) == 2
            and any(id(a) in self.results for a in pair)
            and any(id(a) in self.pref for a in pair)
        )

    def _bias(self, args, out) -> None:
        """``linear_out + param`` right after a consumer op: that parameter is the consumer's bias.

        Recorded only when the parameter has exactly the shape ``W b`` has (the weight's shape without the
        contracted axis), so a fold can add ``W b`` to it; any other added parameter leaves the consumer
        without a bias, which keeps a norm with a bias unfolded (safe)."""
        result, other = (args[0], args[1]) if id(args[0]) in self.results else (args[1], args[0])
        ref = self.pref[id(other)]
        param_shape = tuple(self.params[ref.param].shape)
        for use in self.results[id(result)]:
            weight_shape = list(self.params[use.consumer.param].shape)
            del weight_shape[use.consumer.axis]
            if use.consumer.bias is None and tuple(weight_shape) == param_shape:
                use.consumer = replace(use.consumer, bias=ref.param)
        self.param_uses[ref.param].append(("add", self._module()))

    def _consumer_module(self, param: str) -> str:
        owners = self.owners.get(param, [])
        for frame in reversed(self.stack):
            for mod, _ in owners:
                if mod == frame:
                    return mod
        return owners[0][0] if owners else param.rsplit(".", 1)[0]


@dataclass(frozen=True)
class ExampleInputs:
    """Positional and keyword inputs of one forward, ``model(*args, **kwargs)``, as ``torch.export`` takes.

    Build one with ``ExampleInputs.of(value)``, which accepts ``(args_tuple, kwargs_dict)``, a tuple of
    positional arguments, a dict of keyword arguments or a single tensor (one positional argument).
    """

    args: tuple = ()
    kwargs: dict = field(default_factory=dict)

    @classmethod
    def of(cls, value) -> ExampleInputs:
        """Normalize ``value`` (see the class docstring) to ``ExampleInputs``.

        Raises:
            TypeError: ``value`` is none of the accepted forms.
        """
        if isinstance(value, ExampleInputs):
            return value
        if isinstance(value, torch.Tensor):
            return cls((value,), {})
        if isinstance(value, dict):
            return cls((), dict(value))
        if isinstance(value, tuple | list):
            if len(value) == 2 and isinstance(value[0], tuple | list) and isinstance(value[1], dict):
                return cls(tuple(value[0]), dict(value[1]))
            return cls(tuple(value), {})
        raise TypeError(
            f"example_inputs must be (args, kwargs), a tuple of args, a dict of kwargs or a tensor, "
            f"got {type(value).__name__}"
        )


Inputs = torch.Tensor | ExampleInputs | None  # input_ids, explicit example inputs, or the default ids

SHORT_POSITIONS = 32  # positions of a short forward (the trace of convert, streamed or not)


def short_inputs(inputs: Inputs, positions: int = SHORT_POSITIONS) -> Inputs:
    """``inputs`` for a forward whose outcome does not depend on the sequence length (the trace's dataflow,
    the untie proof): token ids (a ``(batch, seq)`` tensor) cut to their first ``positions``; None and
    explicit ``ExampleInputs`` as given (nothing is known about their axes)."""
    if isinstance(inputs, torch.Tensor) and inputs.ndim == 2 and inputs.shape[-1] > positions:
        return inputs[:, :positions]
    return inputs


def example_inputs(model: nn.Module, inputs: Inputs = None) -> ExampleInputs:
    """The inputs of the walk's forward.

    Explicit ``ExampleInputs`` are used exactly as given. Otherwise the model is called with keyword
    ``input_ids`` (``inputs`` when it is a tensor, else 2 x 16 fixed random ids below the vocabulary size),
    the decoder's ids for an encoder-decoder, and ``use_cache=False`` where the forward takes it. A model
    whose main input is a waveform or an image (``signal_inputs``) gets that instead when ``inputs`` is None.
    """
    if isinstance(inputs, ExampleInputs):
        return inputs
    input_ids = inputs
    config = getattr(model, "config", None)
    if input_ids is None and (signal := signal_inputs(model)) is not None:
        return signal
    if input_ids is None:
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        vocab = int(getattr(text, "vocab_size", None) or 128)
        gen = torch.Generator(device="cpu").manual_seed(0)
        input_ids = torch.randint(0, vocab, (2, 16), generator=gen, device="cpu")
    kwargs = {"input_ids": input_ids.to(model_device(model))}
    if _accepts(model, "use_cache"):
        kwargs["use_cache"] = False
    if getattr(config, "is_encoder_decoder", False):
        kwargs["decoder_input_ids"] = kwargs["input_ids"]
    return ExampleInputs((), kwargs)


AUDIO_SAMPLES = 4000  # a default waveform: 0.25 s at 16 kHz, a dozen frames after a wav2vec2-style encoder
IMAGE_SIZE = 224  # a default image's side when the config names no image_size


def signal_inputs(model: nn.Module, seed: int = 0, samples: int = AUDIO_SAMPLES) -> ExampleInputs | None:
    """Default inputs of a model whose ``main_input_name`` (the transformers attribute saying what its
    forward reads first) is a waveform or an image, or None for any other model (token ids).

    ``input_values``: ``(2, samples)`` N(0, 1) samples; ``pixel_values``: ``(2, num_channels, H, W)``
    N(0, 1) values with ``num_channels`` (default 3) and ``image_size`` (default ``IMAGE_SIZE``) of the
    config. In the dtype of the model's first floating parameter, on its input device, from a CPU generator
    seeded with ``seed``: the same values on every run and every device.
    """
    name = getattr(model, "main_input_name", None)
    if name not in ("input_values", "pixel_values"):
        return None
    config = getattr(model, "config", None)
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    if name == "input_values":
        shape: tuple[int, ...] = (2, samples)
    else:
        size = getattr(config, "image_size", None) or IMAGE_SIZE
        height, width = (size, size) if isinstance(size, int) else tuple(size)[:2]
        shape = (2, int(getattr(config, "num_channels", None) or 3), height, width)
    value = torch.randn(shape, generator=gen, device="cpu").to(model_device(model), dtype)
    return ExampleInputs((), {name: value})


@torch.no_grad()
def run_example(model: nn.Module, inputs: Inputs = None):
    """One plain forward (eval mode, no grad) on ``example_inputs``; the model's modes are restored."""
    example = example_inputs(model, inputs)
    modes = {m: m.training for m in model.modules()}
    for m in modes:
        m.training = False
    try:
        return model(*example.args, **example.kwargs)
    finally:
        for m, mode in modes.items():
            m.training = mode


def trace_example(model: nn.Module, inputs: Inputs = None, hidden_states: bool = False) -> ExampleInputs:
    """The traced forward's inputs: ``example_inputs``, plus ``logits_to_keep=1`` where the forward names
    that argument (not for explicit ``ExampleInputs``, which are used exactly as given), plus
    ``output_hidden_states=True`` where the forward takes it when ``hidden_states`` is set (then every norm
    whose output the model returns as a hidden state is seen as returned, and is not folded).

    The head then maps one position, not all: the trace follows the same ops (the final norm's output is
    sliced along the positions, ``__getitem__``, then read by the head's linear map), and the head's
    ``(positions, vocabulary)`` logits, most of the forward's cost for a large vocabulary (Gemma 3's
    262144 entries), are not computed. Only the trace does this; ``run_example`` keeps every position.
    """
    example = example_inputs(model, inputs)
    if hidden_states and _accepts(model, "output_hidden_states"):
        example = ExampleInputs(example.args, {**example.kwargs, "output_hidden_states": True})
    if isinstance(inputs, ExampleInputs) or "logits_to_keep" not in _named_arguments(model):
        return example
    return ExampleInputs(example.args, {**example.kwargs, "logits_to_keep": 1})


def trace(
    model: nn.Module, inputs: Inputs = None, hidden_states: bool = False, record: bool = False
) -> tuple[_Tracer, object]:
    """Run one forward of ``model`` under the tracer (on ``trace_example``) and return it with the model's
    output; with ``record``, the tracer's ``recorder`` holds the graph of that forward (``recording``; its
    ``finish`` still to be called with the norms' names)."""
    example = trace_example(model, inputs, hidden_states)
    tracer = _Tracer(model, record)
    modes = {m: m.training for m in model.modules()}
    for m in modes:
        m.training = False  # eval mode without calling train()/eval(), which a model may override
    handles = [
        nn.modules.module.register_module_forward_pre_hook(tracer.pre_hook),
        nn.modules.module.register_module_forward_hook(tracer.post_hook, with_kwargs=True),
    ]
    try:
        with torch.no_grad(), read_names(tie_configs(model)) as reads, tracer:
            output = model(*example.args, **example.kwargs)
            if tracer.recorder is not None:
                tracer.recorder.output(output)
            tracer.replay_idle_siblings(model)
        tracer.config_reads = reads
    finally:
        for h in handles:
            h.remove()
        for m, mode in modes.items():
            m.training = mode
    return tracer, output


def _named_arguments(model: nn.Module) -> set[str]:
    """The names of ``model.forward``'s arguments (not what ``**kwargs`` would take)."""
    return set(inspect.signature(model.forward).parameters)


def _accepts(model: nn.Module, keyword: str) -> bool:
    """Whether ``model.forward`` takes ``keyword`` (by name or through ``**kwargs``)."""
    params = inspect.signature(model.forward).parameters.values()
    return any(p.name == keyword or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


accepts = _accepts  # public name for the check, which passes output_hidden_states where a forward takes it


def record_forward(model: nn.Module, site_names: list[str], inputs: Inputs = None) -> Recorder:
    """The graph of one traced forward of ``model`` (``normswap.recording``), with the modules
    ``site_names`` as its norms: what ``walk(..., record=True)`` keeps, for a walk made without it."""
    return trace(model, inputs, record=True)[0].recorder.finish(site_names)


@exact_float32()
def walk(
    model: nn.Module, inputs: Inputs = None, keep_hidden_states: bool = False, record: bool = False
) -> Walk:
    """Find the norms of ``model`` and what consumes each one's output.

    Args:
        model: any ``nn.Module``; left exactly as it was (parameters, modes, hooks).
        inputs: the trace's inputs: ``(batch, seq)`` int64 ``input_ids`` (a tensor), ``ExampleInputs`` for
            a forward that takes other arguments, or None for 2 x 16 random ids (fixed seed).
        keep_hidden_states: trace with ``output_hidden_states=True`` (where the forward takes it): a norm
            whose output is returned as a hidden state (the final norm) is then not foldable ("output is
            returned as a model output"), so the converted model's hidden states stay the original's.
        record: also record the graph of the same forward (``normswap.recording.Recorder``, with the norms
            found), for centering and the rotation: ``Walk.recording``. It holds every tensor of that
            forward until it is dropped.

    Returns:
        A ``Walk`` with one ``NormSite`` per norm module, in the order the forward first called them.

    Raises:
        Whatever the model's forward raises on the example inputs.
        NormswapError: parameters offloaded by accelerate (``normswap.device.refuse_offloaded``).
    """
    refuse_offloaded(model)
    tracer, output = trace(model, inputs, keep_hidden_states, record)
    flat, _ = tree_flatten(output if not hasattr(output, "to_tuple") else output.to_tuple())
    for t in flat:
        if isinstance(t, torch.Tensor) and id(t) in tracer.tags:
            tracer._nonlinear(tracer.tags[id(t)], "output", "is returned as a model output")
        produced = tracer.produced.get(id(t)) if isinstance(t, torch.Tensor) else None
        if produced is not None and produced.ref() is t:
            produced.uses.append(("output", ""))
    failures: dict[str, str] = {}
    sites = _sites(tracer, failures)
    sites += _unreached(model, tracer)
    all_params = {name for name in tracer.owners}
    used = set(tracer.param_uses)
    untouched = sorted(
        n for n in all_params - used if model.get_parameter(n).ndim >= 2 and not _is_norm_param(n, sites)
    )
    for site in sites:
        if site.foldable and site.producer is None:  # a fold into a producer reads no consumer
            _guard_untouched(site, untouched, tracer.params)
    other_uses = {call.module: [u.reason for u in call.uses if u.reason is not None] for call in tracer.calls}
    return Walk(
        sites=sites, param_uses=dict(tracer.param_uses), owners=dict(tracer.owners), untouched=untouched,
        probe_failures=failures, config_reads=frozenset(tracer.config_reads),
        other_uses={s.name: other_uses[s.name] for s in sites if other_uses.get(s.name)},
        recording=None if tracer.recorder is None else tracer.recorder.finish([s.name for s in sites]),
    )  # fmt: skip


def _common_depth(a: str, b: str) -> int:
    """Number of leading module-path components ``a`` and ``b`` share."""
    depth = 0
    for x, y in zip(a.split("."), b.split("."), strict=False):
        if x != y:
            break
        depth += 1
    return depth


def _guard_untouched(site: NormSite, untouched: list[str], params: dict[str, torch.Tensor]) -> None:
    """Keep a norm unfolded when a parameter no op used could be one of its consumers on other inputs.

    Such a parameter (one with an axis as wide as the norm's features) is suspect when it sits closer to a
    consumer than the norm does: inside the part of the model the norm's output flows into (an expert that
    received no token and that ``replay_idle_siblings`` could not run). Folding would then scale the
    consumers seen but not that one, so the site is left unfolded, with the parameter named.
    """
    width = site.shape[-1]
    for param in untouched:
        if width not in params[param].shape:
            continue
        for c in site.consumers:
            if _common_depth(param, c.module) > _common_depth(site.name, c.module):
                site.decide("walk", foldable=False, reason=(
                    f"parameter {param} next to consumer {c.module} was never used in the trace and may "
                    f"read this norm's output on other inputs"
                ))  # fmt: skip
                return


def _is_norm_param(name: str, sites: list[NormSite]) -> bool:
    return any(name in (f"{s.name}.{s.weight}", f"{s.name}.{s.bias}") for s in sites)


def _sites(tracer: _Tracer, failures: dict[str, str]) -> list[NormSite]:
    found: list[tuple[SourceCall, NormSite, nn.Module]] = []
    affine_tried: set[int] = set()
    for call, module in zip(tracer.calls, tracer.module_of_call, strict=True):
        if call.feature is None:  # a norm candidate
            try:
                site = probe_module(module, call.input_shape, call.module, call.input_dtype)
            except ProbeError as error:
                if call.module not in failures:
                    log.warning("%s: probing failed (%s); not treated as a norm", call.module, error)
                failures[call.module] = str(error)
                continue
            if site is not None:
                found.append((call, site, module))
                continue
        if id(module) not in affine_tried:  # not a norm: a per-channel affine map along one of its axes?
            affine_tried.add(id(module))
            found += _affine_site(tracer, module)
    names = {site.name for _, site, _ in found}
    for name in names & failures.keys():  # another call of the same module probed fine
        del failures[name]
    sites = []
    for call, site, module in found:
        # a parameter-free wrapper around a norm: keep the innermost module only
        if any(other.startswith(site.name + ".") for other in names):
            continue
        if site.kind in AFFINE_KINDS:
            site = replace(site, consumers=[u.consumer for u in call.uses if u.consumer is not None])
            reasons = [u.reason for u in call.uses if u.reason is not None]
            foldable, reason, producer = affine_foldability(site, call, reasons, module)
            site = replace(site, producer=producer)
        else:  # a norm folds into linear maps only (``fold.py``): a convolution reading it is another use
            site = replace(site, consumers=[
                u.consumer for u in call.uses if u.consumer is not None and u.op not in _CONV_OPS
            ])  # fmt: skip
            reasons = [
                u.reason or f"feeds {u.op} in {u.module}"
                for u in call.uses
                if u.reason is not None or u.op in _CONV_OPS
            ]
            site = replace(site, swappable=not call.extra)  # another input: not a plain norm, left in place
            foldable, reason = _foldability(site, call, reasons)
        broken = nonfinite_tensors(module)
        if broken:  # listed, never folded: its NaN/inf would spread into every consumer
            foldable, reason, site = False, f"{broken[0]} not finite", replace(site, producer=None)
        elif foldable and site.dtype == "float64" and site.compute_dtype and site.cast_order == "fp32":
            # a float64 fold would skip the float32 rounding of the weight product: off by ~1e-7 relative
            foldable = False
            reason = "multiplies by its weight in float32 inside a float64 model: a fold is not exact"
        site.decide("walk", foldable=foldable, reason=reason)
        sites.append(site)
    return sites


def _affine_site(tracer: _Tracer, module: nn.Module) -> list[tuple[SourceCall, NormSite, nn.Module]]:
    """``module`` probed as a per-channel affine map (``normswap.affine``) along the axes its sources
    followed; the source of the axis it acts on, with its site, or nothing."""
    sources = {}
    for call, other in zip(tracer.calls, tracer.module_of_call, strict=True):
        if other is module:
            sources[len(call.input_shape) - 1 if call.feature is None else call.feature] = call
    if not sources:
        return []
    first = next(iter(sources.values()))
    site = probe_affine(module, first.input_shape, first.module, axes=list(sources))
    return [] if site is None else [(sources[site.axis], site, module)]


NOT_REACHED = "not reached by the trace"


def _unreached(model: nn.Module, tracer: _Tracer) -> list[NormSite]:
    """Norms among the modules the forward never called (a vision tower on a text-only trace).

    A leaf module that holds one or two tensors of the same shape ``S`` (1-D, or a per-head ``(H, D)``) is
    probed on a synthetic input of shape ``(2, 4, *S)``; those that behave as norms are listed with the
    reason ``NOT_REACHED``: their semantics are known, their consumers are not, so they are never folded.
    A leaf that is not such a norm but could be a per-channel affine map (``normswap.affine.channels``: a
    BatchNorm, NoNorm) is probed on ``(2, C)``, ``(2, C, 3)``, ``(2, 3, C)``, ``(2, C, 3, 3)`` and
    ``(2, C, 3, 3, 3)`` with the channel axis the length-``C`` one; listed the same way if one fits.
    """
    sites = []
    for name, module in model.named_modules():
        if not name or id(module) in tracer.called or any(True for _ in module.children()):
            continue
        tensors = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
        shape = tuple(tensors[0].shape) if tensors else ()
        site = None
        if 1 <= len(shape) <= 2 and all(tuple(t.shape) == shape for t in tensors):
            try:
                site = probe_module(module, (2, 4, *shape), name)
            except ProbeError:  # it cannot take the synthetic input: nothing known about it, not listed
                continue
        if site is None:
            site = _unreached_affine(module, name)
        if site is not None:
            site = replace(site, reached=False)
            site.decide("walk", foldable=False, reason=NOT_REACHED)
            sites.append(site)
    return sites


def _unreached_affine(module: nn.Module, name: str) -> NormSite | None:
    count = channels(module)
    if count is None:
        return None
    for shape, axis in (((2, count), 1), ((2, count, 3), 1), ((2, 3, count), 2), ((2, count, 3, 3), 1),
                        ((2, count, 3, 3, 3), 1)):  # fmt: skip
        site = probe_affine(module, shape, name, axes=[axis])
        if site is not None:
            return site
    return None


def _foldability(site: NormSite, call: SourceCall, reasons: list[str]) -> tuple[bool, str | None]:
    if call.extra:  # not swappable either (``_sites``)
        return False, f"called with another input ({call.extra}): not a one-input norm, left in place"
    if reasons:
        return False, f"output {reasons[0]}"
    if site.weight is None and site.bias is None:
        return False, "parameter-free norm: nothing to fold"
    if not site.consumers:
        return False, "output is never used by a linear map"
    if len(site.shape) != 1:
        return False, f"per-head scale of shape {tuple(site.shape)} does not map onto one consumer axis"
    if site.bias is not None:
        missing = sorted({c.module for c in site.consumers if c.bias is None})
        if missing:
            return False, f"consumer {missing[0]} has no bias to absorb the norm's bias"
    return True, None


# Public names for the code that sees the same ops as the tracer (fake quantization, learned rotation, the
# streamed model's guard).
func_name = _func_name  # the op name of a torch function as ``__torch_function__`` receives it
METADATA_OPS = _IGNORED  # ops that read only a tensor's metadata (shape, dtype, device), never its values
