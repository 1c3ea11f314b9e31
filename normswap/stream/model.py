"""A model whose large weights stay on disk and are read as each module runs.

The model is built from its config with accelerate's ``init_empty_weights`` (no weight memory). Parameters of
at most one dimension (norm scales and biases, linear biases) are read once and stay resident, so the probe,
the fold plan and the fused modules see the real norm parameters. Every larger parameter becomes a
*released placeholder*: a tensor of the right shape, dtype and device whose storage holds no bytes. A forward
pre-hook on each module that holds such a parameter reads it from the checkpoint just before the module runs
(cast to the placeholder's current dtype, so ``check.upcast`` works), and a forward hook releases the storage
again right after, so a forward holds one module's weights at a time.

The Parameter objects themselves never change (only their data), so the walk's dataflow trace, which knows
parameters by identity, sees the same model as in memory. accelerate's own offload hooks
(``AlignDevicesHook``) install new Parameter objects on each call instead, which the trace cannot follow.

A parameter read outside the forward of a module that holds it would find no bytes; every transformers
model streamed so far reads its weights only inside their modules (the tests compare plans and logits with
the in-memory path on several architectures).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from normswap.errors import NormswapError
from normswap.stream.shards import CheckpointReader


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

    ``copy.deepcopy`` (the probe copies candidate modules) returns a plain Parameter holding the real
    values, read from disk when released, as a deep copy of the in-memory model's Parameter would.
    """

    def __deepcopy__(self, memo):
        if id(self) in memo:
            return memo[id(self)]
        if is_released(self):
            data = self.stream_reader.read(self.stream_key, self.dtype, self.device)
        else:
            data = self.data.clone()
        memo[id(self)] = result = nn.Parameter(data, requires_grad=self.requires_grad)
        return result


def stand_in(shape, dtype: torch.dtype, device, key: str, reader: CheckpointReader) -> StreamedParameter:
    """A released ``StreamedParameter`` for checkpoint tensor ``key``."""
    p = StreamedParameter(placeholder(shape, dtype, device), requires_grad=False)
    p.stream_key, p.stream_reader = key, reader
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
    """

    model: nn.Module
    reader: CheckpointReader
    keys: dict[str, str]
    handles: list = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()

    def copy(self, name: str, old: nn.Parameter) -> nn.Parameter:
        """A new placeholder Parameter for ``name`` read from the same checkpoint tensor as ``old``: the
        ``copy`` that ``normswap.fold.untie_parameters`` gives an untied Parameter of a streamed model."""
        return stand_in(old.shape, old.dtype, old.device, self.keys[name], self.reader)


def _load(module: nn.Module, attrs: dict[str, str], reader: CheckpointReader) -> None:
    for attr, key in attrs.items():
        p = module._parameters[attr]
        if is_released(p):
            p.data = reader.read(key, p.dtype, p.device)


def _release(module: nn.Module, attrs: dict[str, str]) -> None:
    for attr in attrs:
        p = module._parameters[attr]
        if not is_released(p):
            p.untyped_storage().resize_(0)  # frees the bytes even where the trace keeps a view


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
        reader: the checkpoint's tensors; its names must be the model's parameter names.
        dtype: floating dtype of the parameters (checkpoint tensors are cast to it as they are read).
        device: where the weights are read to and the model runs.
        trust_remote_code: build the class of the model's own code (``config.auto_map``).

    Raises:
        NormswapError: a parameter has no tensor in the checkpoint, a checkpoint tensor belongs to no
            parameter or buffer (and is not one transformers' loader drops by design), or a shape differs.
    """
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    from normswap.io.carry import loader_ignores

    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)
    model.tie_weights()
    model.eval()
    keys: dict[str, str] = {}
    source = str(reader.folder)
    by_object: dict[int, str] = {}
    for mod_name, module in model.named_modules(remove_duplicate=False):
        for attr, p in module._parameters.items():
            if p is None:
                continue
            name = f"{mod_name}.{attr}" if mod_name else attr
            if id(p) not in by_object and name in reader.tensors:
                by_object[id(p)] = name
    for name, p in model.named_parameters(remove_duplicate=False):
        key = by_object.get(id(p))
        if key is None:
            raise NormswapError(
                f"{source}: the checkpoint has no tensor {name} (streaming needs the checkpoint's tensor "
                "names to be the model's; transformers renames or stacks some models' tensors on loading)"
            )
        if tuple(reader.tensors[key].shape) != tuple(p.shape):
            raise NormswapError(f"{source}: tensor {key} has shape {reader.tensors[key].shape}, the model "
                                f"expects {tuple(p.shape)}")  # fmt: skip
        keys[name] = key
    persistent = {}
    for mod_name, module in model.named_modules():
        for attr, b in module._buffers.items():
            name = f"{mod_name}.{attr}" if mod_name else attr
            if b is not None and attr not in module._non_persistent_buffers_set and name in reader.tensors:
                persistent[name] = (module, attr)
    extra = set(reader.tensors) - set(keys.values()) - set(persistent)
    skipped = loader_ignores(model, extra)
    unexpected = sorted(extra - skipped)
    if unexpected:
        raise NormswapError(
            f"{source}: the checkpoint has tensor {unexpected[0]}, which the model does not expect"
        )
    with torch.no_grad():
        for name, (module, attr) in persistent.items():
            module._buffers[attr] = reader.read(name, module._buffers[attr].dtype, device)
            keys[name] = name
    order = {name: (info.file, info.start) for name, info in reader.tensors.items()}
    streamed = Streamed(model, reader, keys, skipped=sorted(skipped, key=order.__getitem__))
    replaced: dict[int, nn.Parameter] = {}  # id of the meta Parameter -> its stand-in (tied ones stay shared)
    for mod_name, module in model.named_modules(remove_duplicate=False):
        attrs = {}
        for attr, p in module._parameters.items():
            if p is None:
                continue
            name = f"{mod_name}.{attr}" if mod_name else attr
            if id(p) not in replaced:
                if p.ndim <= 1:
                    replaced[id(p)] = nn.Parameter(
                        reader.read(keys[name], dtype, device), requires_grad=False
                    )
                else:
                    replaced[id(p)] = stand_in(p.shape, dtype, device, keys[name], reader)
            module._parameters[attr] = replaced[id(p)]
            if p.ndim > 1:
                attrs[attr] = keys[name]
        if attrs:
            streamed.handles.append(module.register_forward_pre_hook(
                lambda m, args, attrs=attrs: _load(m, attrs, reader)))  # fmt: skip
            streamed.handles.append(module.register_forward_hook(
                lambda m, args, out, attrs=attrs: _release(m, attrs)))  # fmt: skip
    return streamed
