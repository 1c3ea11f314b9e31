"""A model whose large weights stay on disk and are read as each module runs.

The model is built from its config with accelerate's ``init_empty_weights`` (no weight memory). Parameters of
at most one dimension (norm scales and biases, linear biases), and larger ones no bigger than those (a
per-head norm's ``[heads, head_dim]`` scale: ``resident_parameters``), are read once and stay resident, so
the probe, the fold plan and the fused modules see the real norm parameters. Every larger parameter becomes a
*released placeholder*: a tensor of the right shape, dtype and device whose storage holds no bytes. A forward
pre-hook on each module that holds such a parameter reads it from the checkpoint just before the module runs
(cast to the placeholder's current dtype, so ``check.upcast`` works), and a forward hook releases the storage
again right after, so a forward holds one module's weights at a time.

The Parameter objects themselves never change (only their data), so the walk's dataflow trace, which knows
parameters by identity, sees the same model as in memory. accelerate's own offload hooks
(``AlignDevicesHook``) install new Parameter objects on each call instead, which the trace cannot follow.

A parameter that transformers assembles from several checkpoint tensors as it loads (its weight-conversion
mapping: per-expert tensors stacked into ``experts.gate_up_proj``) is released the same way; its values are
assembled as it is read, by transformers' own converter on the tensors read from the shards
(``stream.assemble``), and the bytes held count its assembled size.

A parameter read outside the forward of the module that holds it (Qwen3-Next's linear attention passes
``self.conv1d.weight`` to its convolution function, never calling the ``Conv1d``) is read from the checkpoint
as it is used: ``StreamedParameter.__torch_function__`` sees every torch function that takes it, and one that
reads its values (anything but its metadata: shape, dtype, device, hashing) reads it first. It is released
again when the forward of the innermost module running at that moment returns (every module's forward is
hooked to know which that is), so such a read holds it no longer than the module that read it runs.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from normswap.errors import NormswapError
from normswap.io.shards import CheckpointReader
from normswap.stream.assemble import Group, groups
from normswap.walk import METADATA_OPS, func_name

# torch functions that read a tensor's metadata, never its values: no read from the checkpoint for them (the
# walk's list, and the ``data`` property, read and set by the hooks themselves)
_NO_VALUES = frozenset(METADATA_OPS) | {"data", "requires_grad_", "is_inference", "is_nested", "_is_view",
                                         "is_shared", "is_pinned", "output_nr", "_version", "_base",
                                         "__reduce_ex__", "__getstate__", "__setstate__"}  # fmt: skip


def placeholder(shape, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A released tensor: ``shape``, ``dtype`` and ``device`` as given, storage of 0 bytes."""
    t = torch.empty(shape, dtype=dtype, device=device)
    t.untyped_storage().resize_(0)
    return t


def is_released(t: torch.Tensor) -> bool:
    """Whether ``t`` is a placeholder whose bytes are on disk (a non-empty tensor with an empty storage)."""
    return t.numel() > 0 and t.untyped_storage().nbytes() == 0


class StreamedParameter(nn.Parameter):
    """A Parameter whose bytes may be released; it knows the checkpoint tensor they come from.

    Attributes:
        stream_key: the checkpoint tensor its values are read from (for an assembled parameter, its own model
            name).
        stream_reader: the ``CheckpointReader`` of that checkpoint.
        stream_group: None, or the ``assemble.Group`` whose conversion makes its values from several
            checkpoint tensors (transformers' ``WeightConverter``: per-expert tensors stacked).
        stream_ops: transforms applied, in order, to the values as read (``Streamed.transform``: the
            centering of a writer's weight, ...); each maps a tensor to a new one of the same shape, dtype
            and device.
        stream_owner: the ``Streamed`` model that reads it when a torch function needs its values while it is
            released (``__torch_function__``); None for a resident one.

    ``copy.deepcopy`` (the probe copies candidate modules, the fold plan reads consumer weights) returns a
    plain Parameter holding the current values, read from disk and transformed when released, as a deep
    copy of the in-memory model's Parameter would.
    """

    def __deepcopy__(self, memo):
        if id(self) in memo:
            return memo[id(self)]
        data = values(self) if is_released(self) else self.data.clone()
        memo[id(self)] = result = nn.Parameter(data, requires_grad=self.requires_grad)
        return result

    def by_rows(self) -> bool:
        """Whether it is read one row (expert) at a time: released, assembled by a slot-wise group
        (``assemble.Group.slotwise``) with no transforms, and of a streamed model (its module's forward
        leaves it released; ``self[i]`` reads row ``i``, any other read the whole)."""
        group = getattr(self, "stream_group", None)
        owner = getattr(self, "stream_owner", None)
        with torch._C.DisableTorchFunctionSubclass():
            return owner is not None and group is not None and group.slotwise and not self.stream_ops and (
                is_released(self))  # fmt: skip

    def rows(self):
        """Its rows along the first axis, each ``(1, *rest)`` in its dtype, read one at a time when it is
        released (``by_rows``), else views (``normswap.fold.input_peaks`` reduces a stack of experts so)."""
        if not self.by_rows():
            with torch._C.DisableTorchFunctionSubclass():
                yield from self.detach().split(1)
            return
        for i in range(self.shape[0]):
            yield self.stream_owner.row(self, i).unsqueeze(0)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        """As ``nn.Parameter``'s (the function runs on plain tensors, and returns them), after reading every
        released argument whose values ``func`` needs (``Streamed.fetch``): a weight read outside its
        module's forward. ``p[i]`` of a parameter read by rows (``by_rows``: an expert's weights, as the
        eager experts forward takes them) reads row ``i`` only."""
        kwargs = kwargs or {}
        if func is torch.Tensor.__getitem__ and not kwargs and len(args) == 2:
            p, index = args
            if isinstance(p, StreamedParameter) and p.by_rows() and _row_index(index) is not None:
                with torch._C.DisableTorchFunctionSubclass():
                    return p.stream_owner.row(p, _row_index(index))
        with torch._C.DisableTorchFunctionSubclass():
            if func_name(func) not in _NO_VALUES:
                for a in tree_flatten((args, kwargs))[0]:
                    owner = getattr(a, "stream_owner", None) if isinstance(a, StreamedParameter) else None
                    if owner is not None and is_released(a):
                        owner.fetch(a)
            return func(*args, **kwargs)


def _row_index(index) -> int | None:
    """``index`` as one row of the first axis (an int, or a 0-d integer tensor), or None (a boolean mask,
    a slice, several indices: the whole parameter is read)."""
    if isinstance(index, int) and not isinstance(index, bool):
        return index
    if isinstance(index, torch.Tensor) and index.ndim == 0 and not index.is_floating_point():
        return None if index.dtype == torch.bool or index.is_complex() else int(index)
    return None


def read_source(
    reader: CheckpointReader, key: str, group: Group | None, dtype: torch.dtype, device
) -> torch.Tensor:
    """Checkpoint tensor ``key`` in ``dtype`` (when floating) on ``device``; with a ``group``, the model
    parameter ``key`` that the group assembles from its checkpoint tensors, each read so."""
    if group is None:
        return reader.read(key, dtype, device)
    if group.slotwise:
        return _by_rows(reader, key, group, dtype, device, dtype)
    return group.assemble(lambda name: reader.read(name, dtype, device))[key]


def read_row(reader: CheckpointReader, key: str, group: Group, dtype: torch.dtype, device, i: int):
    """Row ``i`` (first axis: one expert) of the parameter ``key`` of a slot-wise ``group``, made from that
    row's checkpoint tensors only (``assemble.Group.assemble_slot``), in ``dtype`` on ``device``."""
    return group.assemble_slot(lambda name: reader.read(name, dtype, device), i)[key][0]


def _by_rows(reader, key, group, dtype, device, out_dtype) -> torch.Tensor:
    """The whole parameter, made row by row into one tensor of ``out_dtype`` (each row cast as it is made):
    the whole tensor and one row held, not every checkpoint tensor beside the stacks the converter makes."""
    first = read_row(reader, key, group, dtype, device, 0)
    out = torch.empty((group.slots, *first.shape), dtype=out_dtype, device=device)
    out[0] = first
    del first
    for i in range(1, group.slots):
        out[i] = read_row(reader, key, group, dtype, device, i)
    return out


def values(p: StreamedParameter) -> torch.Tensor:
    """The values of a released ``p`` on ``p.device``: its checkpoint tensor read (or its tensors read and
    assembled, ``p.stream_group``) in the dtype the model was built in (``p.stream_dtype``), ``p.stream_ops``
    applied, then cast to ``p.dtype`` where that differs (``normswap.check.upcast`` holds a half-precision
    model in float32: exact, as in memory)."""
    group = p.stream_group
    if group is not None and group.slotwise and not p.stream_ops:  # each row cast as it is made
        return _by_rows(p.stream_reader, p.stream_key, group, p.stream_dtype, p.device, p.dtype)
    t = read_source(p.stream_reader, p.stream_key, group, p.stream_dtype, p.device)
    for op in p.stream_ops:
        t = op(t)
    return t if t.dtype == p.dtype or not t.is_floating_point() else t.to(p.dtype)


def stand_in(
    shape, dtype: torch.dtype, device, key: str, reader: CheckpointReader, ops=(), group: Group | None = None
) -> StreamedParameter:
    """A released ``StreamedParameter`` for checkpoint tensor ``key`` (with the transforms ``ops``), or for
    the parameter ``key`` that ``group`` assembles."""
    p = StreamedParameter(placeholder(shape, dtype, device), requires_grad=False)
    p.stream_key, p.stream_reader, p.stream_ops, p.stream_dtype = key, reader, list(ops), dtype
    p.stream_group, p.stream_owner = group, None
    return p


def resident(
    data: torch.Tensor, key: str, reader: CheckpointReader, group: Group | None = None
) -> StreamedParameter:
    """A ``StreamedParameter`` holding ``data`` (read from ``key``, or assembled by ``group``) for good: a
    norm scale, a bias."""
    p = StreamedParameter(data, requires_grad=False)
    p.stream_key, p.stream_reader, p.stream_ops, p.stream_dtype = key, reader, [], data.dtype
    p.stream_group, p.stream_owner = group, None
    return p


@dataclass
class Streamed:
    """A streamed model and where each of its parameters comes from.

    Attributes:
        model: the ``nn.Module`` (eval mode).
        reader: the checkpoint it reads.
        keys: qualified parameter or buffer name (every name a tied Parameter has) -> checkpoint tensor name.
        handles: the hook handles (``close()`` removes them).
        skipped: checkpoint tensors the model class does not hold and transformers' loader drops by design
            (``normswap.io.carry.loader_ignores``: a multi-token-prediction layer), in checkpoint order; the
            conversion writes them unchanged.
        held, peak: bytes of weights on the model's device now, and at most so far (the resident
            parameters and buffers, plus the weights of the modules running).
        loaded_as: checkpoint tensor name -> the model tensor name it loads as (``checkpoint_names``).
        saved_name: a model tensor name -> the name ``save_pretrained`` writes it under.
        groups: model parameter name -> the ``assemble.Group`` that makes it from several checkpoint tensors
            (and writes it back as them); ``pieces``: each of those checkpoint tensors -> its group.
        running: the modules whose forward is running, innermost last, each with the parameters read while
            it ran outside their own module's forward (``fetch``), released when it returns; ``loose``: those
            read while no forward ran, released when the next forward returns.
    """

    model: nn.Module
    reader: CheckpointReader
    keys: dict[str, str]
    handles: list = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    held: int = 0
    peak: int = 0
    loaded_as: dict[str, str] = field(default_factory=dict)
    saved_name: Callable[[str], str] = staticmethod(lambda name: name)
    groups: dict[str, Group] = field(default_factory=dict)
    pieces: dict[str, Group] = field(default_factory=dict)
    running: list[tuple[nn.Module, list]] = field(default_factory=list)
    loose: list = field(default_factory=list)

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()
        for p in self.loose:
            self._drop(p)
        self.loose.clear()
        for p in self.own_parameters():
            p.stream_owner = None  # no reads on demand once the hooks that release them are gone

    def own_parameters(self) -> list[StreamedParameter]:
        """The released stand-ins of this model (those ``fetch`` may read)."""
        return [p for p in self.model.parameters() if getattr(p, "stream_owner", None) is self]

    def fetch(self, p: StreamedParameter) -> None:
        """Read a released ``p`` that a torch function needs outside its module's forward; it is released
        when the innermost module running returns (or the next forward, when none runs)."""
        p.data = values(p)
        self.held += _nbytes(p)
        self.peak = max(self.peak, self.held)
        (self.running[-1][1] if self.running else self.loose).append(p)

    def enter(self, module: nn.Module) -> None:
        """A module's forward starts (its forward pre-hook)."""
        self.running.append((module, []))

    def leave(self, module: nn.Module) -> None:
        """A module's forward returned or raised (its forward hook): the parameters read while it ran, and
        while the forwards it left unfinished ran, are released."""
        if not any(m is module for m, _ in self.running):
            return
        while self.running:
            m, fetched = self.running.pop()
            for p in fetched:
                if isinstance(p, weakref.ref):  # a row read for this forward (``row``), still referenced
                    row = p()
                    if row is not None:
                        row.untyped_storage().resize_(0)
                else:
                    self._drop(p)
            if m is module:
                break
        if not self.running:
            for p in self.loose:
                self._drop(p)
            self.loose.clear()

    def _drop(self, p: torch.Tensor) -> None:
        if not is_released(p):
            self.held -= _nbytes(p)
            p.untyped_storage().resize_(0)

    def load(self, module: nn.Module, attrs) -> None:
        """Read the released parameters ``attrs`` of ``module`` (its forward pre-hook)."""
        for attr in attrs:
            p = module._parameters[attr]
            if isinstance(p, StreamedParameter) and is_released(p) and not p.by_rows():
                p.data = values(p)
                self.held += _nbytes(p)
        self.peak = max(self.peak, self.held)

    def row(self, p: StreamedParameter, i: int) -> torch.Tensor:
        """Row ``i`` of a parameter read by rows (``StreamedParameter.by_rows``), in ``p.dtype``; the
        caller holds it (it counts in ``peak`` while it is made). Read during a forward, its storage is
        freed when the innermost module running returns, as a released weight's (a trace may keep the
        tensor: the walk keeps every view of a parameter it follows)."""
        i = i + p.shape[0] if i < 0 else i
        if not 0 <= i < p.shape[0]:
            raise IndexError(f"index {i} is out of bounds for dimension 0 with size {p.shape[0]}")
        t = read_row(self.reader, p.stream_key, p.stream_group, p.stream_dtype, p.device, i)
        t = t if t.dtype == p.dtype else t.to(p.dtype)
        self.peak = max(self.peak, self.held + _nbytes(t))
        if self.running:  # a trace that keeps it (the walk's) keeps no bytes once the reading module returns
            self.running[-1][1].append(weakref.ref(t))
        return t

    def release(self, module: nn.Module, attrs) -> None:
        """Release the parameters ``attrs`` of ``module`` again (its forward hook)."""
        for attr in attrs:
            p = module._parameters[attr]
            self._drop(p)  # frees the bytes even where the trace keeps a view

    def copy(self, name: str, old: nn.Parameter) -> nn.Parameter:
        """A new Parameter for ``name`` with ``old``'s values: the ``copy`` that
        ``normswap.fold.untie_parameters`` (and centering's untie) gives an untied Parameter of a streamed
        model. A released ``old`` gives a placeholder read from the same checkpoint tensor with the same
        transforms so far; a resident one, a clone."""
        group = getattr(old, "stream_group", None)
        key = old.stream_key if group is not None else self.keys[name]  # assembled: as its group names it
        if not is_released(old):
            p = resident(old.detach().clone(), key, self.reader, group)
        else:
            p = stand_in(old.shape, old.stream_dtype, old.device, key, self.reader, old.stream_ops, group)
            p.stream_owner = self if self.handles else None
        p.requires_grad_(old.requires_grad)
        return p

    def transform(self, p: nn.Parameter, op) -> None:
        """Make ``op`` (a tensor -> new tensor of the same shape, dtype and device) part of ``p``'s values.

        A released ``p`` applies it every time its values are read (each forward, each deep copy, the
        written output); a resident one gets ``op(p)`` now, and keeps ``op`` for the record. This is how an
        in-place change of the in-memory pipeline (centering a writer's weight, ...) is streamed: the same
        function on the same values gives the same bytes.

        Raises:
            ValueError: ``p`` is not a parameter of this streamed model.
        """
        if not isinstance(p, StreamedParameter):
            raise ValueError("not a parameter of a streamed model")
        if not is_released(p):
            with torch.no_grad():
                p.data = op(p.data)
        p.stream_ops.append(op)


def checkpoint_names(
    model: nn.Module, tensors, source: str = "checkpoint"
) -> tuple[dict[str, str], Callable[[str], str], list[Group]]:
    """Which checkpoint tensor each model tensor is, as transformers renames and converts them on loading.

    transformers 5 renames some checkpoints' tensors as it loads them and back as it saves
    (``transformers.conversion_mapping``: GPT-NeoX's ``embed_out`` is the model's ``lm_head``; legacy
    ``gamma``/``beta``), and makes some parameters from several tensors (its ``WeightConverter``s:
    Mixtral's per-expert ``w1``/``w3`` stacked and concatenated into ``experts.gate_up_proj``). Renamings are
    followed here; each conversion becomes an ``assemble.Group`` (checked on the meta device: the model's
    names and shapes, and the split back gives exactly the checkpoint's tensors).

    Args:
        model: the model, built on the meta device.
        tensors: checkpoint tensor name -> ``shards.TensorInfo``.
        source: the checkpoint, for messages.

    Returns:
        ``(model tensor name -> checkpoint name for every checkpoint tensor no converter takes, saved_name,
        groups)`` where ``saved_name(model tensor name)`` is the name ``save_pretrained`` writes it under.

    Raises:
        NormswapError: a conversion that cannot be streamed in the checkpoint's own layout
            (``assemble.groups``).
    """
    identity = {name: name for name in tensors}
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key
    except ImportError:  # another transformers layout: names as stored
        return identity, lambda name: name, []
    conversions = get_model_conversion_mapping(model)
    renamings = [c for c in conversions if isinstance(c, WeightRenaming)]
    converters = [c for c in conversions if isinstance(c, WeightConverter)]
    if not renamings and not converters:
        return identity, lambda name: name, []
    meta = dict.fromkeys(model.state_dict(keep_vars=True))
    prefix = getattr(model, "base_model_prefix", None)
    loaded: dict[str, str] = {}
    converted: dict[str, tuple[str, str]] = {}
    for key in tensors:
        renamed, pattern = rename_source_key(key, renamings, converters, prefix, meta)
        if renamed not in meta and key in meta:  # as transformers' loader: the name as stored
            renamed, pattern = key, None
        if pattern is not None and renamed in meta:
            converted[key] = (renamed, pattern)
        else:
            loaded[renamed if renamed in meta else key] = key
    made = groups(model, tensors, conversions, converted, source) if converted else []
    undo = [c.reverse_transform() for c in reversed(conversions) if isinstance(c, WeightRenaming)]

    def saved_name(name: str) -> str:
        for renaming in undo:
            name, _ = renaming.rename_source_key(name)
        return name

    return loaded, saved_name, made


def eager_experts(model: nn.Module) -> None:
    """Run the experts modules with transformers' eager implementation (``set_experts_implementation``),
    which takes one expert's weights at a time (``experts.gate_up_proj[i]``), so a parameter read by rows
    (``StreamedParameter.by_rows``) is never held whole; its default (``grouped_mm``) reads whole stacks.
    The same function, computed in another order (the check and the verification compare two streamed
    models, both eager). A model without the setting keeps its forward (whole reads, still correct). The
    setting lives on ``model.config``, the config object ``build`` was given."""
    setter = getattr(model, "set_experts_implementation", None)
    if setter is None:
        return
    try:
        setter("eager")
    except (ValueError, RuntimeError, ImportError):
        return


def resident_parameters(model: nn.Module) -> set[int]:
    """Ids of the parameters that stay resident: every one of at most one dimension (norm scales, biases),
    and every larger one with no more elements than the largest of those (a per-head norm's
    ``[heads, head_dim]`` scale, a small router), so that each norm the probe copies has its values; the
    memory they hold is bounded like the 1-D ones'. Every other parameter is released between forwards."""
    params = list(model.parameters())
    vector = max((p.numel() for p in params if p.ndim <= 1), default=0)
    return {id(p) for p in params if p.ndim <= 1 or p.numel() <= vector}


def _nbytes(p: torch.Tensor) -> int:
    return p.numel() * p.element_size()


def build(
    config,
    reader: CheckpointReader,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    *,
    trust_remote_code: bool = False,
) -> Streamed:
    """Build the causal LM of ``config`` over the checkpoint ``reader`` (see the module docstring).

    Args:
        config: a transformers config (a causal LM).
        reader: the checkpoint's tensors: the model's parameter names, or names transformers' loader renames
            or assembles into them (``checkpoint_names``).
        dtype: floating dtype of the parameters (checkpoint tensors are cast to it as they are read).
        device: where the weights are read to and the model runs.
        trust_remote_code: build the class of the model's own code (``config.auto_map``).

    Raises:
        NormswapError: a parameter has no tensor in the checkpoint, a checkpoint tensor belongs to no
            parameter or buffer (and is not one transformers' loader drops by design), a shape differs, or
            tensors that transformers assembles do not fit the model or would not be written back as
            themselves (``assemble.groups``).
    """
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    from normswap.io.carry import loader_ignores

    with torch.device("cpu"), init_empty_weights():  # buffers made at construction: on the CPU, then moved
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)
    model.tie_weights()
    model.eval()
    keys: dict[str, str] = {}
    source = str(reader.folder)
    loaded, saved, made = checkpoint_names(model, reader.tensors, source)
    assembled = {name: group for group in made for name in group.targets}
    for name in assembled:
        loaded[name] = name  # read by assembling (``read_source``), under its own name
    by_object: dict[int, str] = {}
    for mod_name, module in model.named_modules(remove_duplicate=False):
        for attr, p in module._parameters.items():
            if p is None:
                continue
            name = f"{mod_name}.{attr}" if mod_name else attr
            if id(p) not in by_object and name in loaded:
                by_object[id(p)] = loaded[name]
    for name, p in model.named_parameters(remove_duplicate=False):
        key = by_object.get(id(p))
        if key is None:
            raise NormswapError(
                f"{source}: the checkpoint has no tensor {name}, nor tensors that transformers renames or "
                "assembles into it on loading"
            )
        if key not in assembled and tuple(reader.tensors[key].shape) != tuple(p.shape):
            raise NormswapError(f"{source}: tensor {key} has shape {reader.tensors[key].shape}, the model "
                                f"expects {tuple(p.shape)}")  # fmt: skip
        keys[name] = key
    persistent = {}
    for mod_name, module in model.named_modules():
        for attr, b in module._buffers.items():
            name = f"{mod_name}.{attr}" if mod_name else attr
            if b is not None and attr not in module._non_persistent_buffers_set and name in loaded:
                persistent[loaded[name]] = (module, attr, name)
    extra = set(reader.tensors) - set(keys.values()) - set(persistent) - {k for g in made for k in g.keys}
    skipped = loader_ignores(model, extra)
    unexpected = sorted(extra - skipped)
    if unexpected:
        raise NormswapError(
            f"{source}: the checkpoint has tensor {unexpected[0]}, which the model does not expect"
        )
    with torch.no_grad():
        for module in model.modules():  # buffers computed at construction (rotary frequencies, masks)
            for attr, b in module._buffers.items():
                if b is not None and b.device != torch.device(device):
                    module._buffers[attr] = b.to(device)
        for key, (module, attr, name) in persistent.items():
            module._buffers[attr] = reader.read(key, module._buffers[attr].dtype, device)
            keys[name] = key
    order = {name: (info.file, info.start) for name, info in reader.tensors.items()}
    streamed = Streamed(model, reader, keys, skipped=sorted(skipped, key=order.__getitem__),
                        loaded_as={v: k for k, v in loaded.items()}, saved_name=saved,
                        groups=assembled, pieces={k: g for g in made for k in g.keys})  # fmt: skip
    replaced: dict[int, nn.Parameter] = {}  # id of the meta Parameter -> its stand-in (tied ones stay shared)
    keep = resident_parameters(model)
    for mod_name, module in model.named_modules(remove_duplicate=False):
        attrs = {}
        for attr, p in module._parameters.items():
            if p is None:
                continue
            name = f"{mod_name}.{attr}" if mod_name else attr
            if id(p) not in replaced:
                key = keys[name]
                group = assembled.get(key)
                if id(p) in keep:
                    data = read_source(reader, key, group, dtype, device)
                    replaced[id(p)] = resident(data, key, reader, group)
                else:
                    replaced[id(p)] = stand_in(p.shape, dtype, device, key, reader, group=group)
            module._parameters[attr] = replaced[id(p)]
            if id(p) not in keep:
                attrs[attr] = keys[name]
        if attrs:
            streamed.handles.append(module.register_forward_pre_hook(
                lambda m, args, attrs=attrs: streamed.load(m, attrs)))  # fmt: skip
            streamed.handles.append(module.register_forward_hook(
                lambda m, args, out, attrs=attrs: streamed.release(m, attrs)))  # fmt: skip
    for module in model.modules():  # which forward runs, for the weights read outside their module's
        streamed.handles.append(module.register_forward_pre_hook(lambda m, args: streamed.enter(m)))
        streamed.handles.append(module.register_forward_hook(lambda m, args, out: streamed.leave(m),
                                                             always_call=True))  # fmt: skip
    for p in {id(p): p for p in replaced.values()}.values():
        if is_released(p):
            p.stream_owner = streamed
    if any(group.slotwise for group in made):
        eager_experts(model)
    resident_tensors = {id(t): t for t in [*model.parameters(), *model.buffers()] if not is_released(t)}
    streamed.held = streamed.peak = sum(_nbytes(t) for t in resident_tensors.values())
    return streamed


def _libc():
    import ctypes
    import ctypes.util

    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def unmap_freed_weights() -> None:
    """On glibc, serve every block of 128 KiB or more with its own memory map, returned to the OS when freed.

    By default glibc raises that threshold to the size of the last large block freed (up to 32 MiB), so the
    weights of a streamed forward come from the heap, where the small tensors allocated in between pin
    them: measured, the peak then grew by about 20 MB per Llama layer (hidden 1024). A fixed 1 MiB
    threshold left about 1 MB per layer: activations of 128 KiB-1 MiB (a k/v projection of 512 tokens,
    the check's float64 samples) fragment the heap. At 128 KiB (glibc's initial value, kept fixed) a
    streamed forward's RSS stays flat from layer to layer. Process-wide (``mallopt(M_MMAP_THRESHOLD)``);
    other allocators are left alone.
    """
    libc = _libc()
    if libc is not None and hasattr(libc, "mallopt"):
        libc.mallopt(-3, 128 << 10)  # M_MMAP_THRESHOLD (also turns off the dynamic threshold)


def release_memory() -> None:
    """Return freed memory to the OS now: collect reference cycles (a forward's outputs, hooks) and, on
    glibc, trim the heap. Called between the stages, so one stage's tensors never add to the next one's."""
    import gc

    gc.collect()
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):  # glibc; other allocators keep their own policy
        libc.malloc_trim(0)
