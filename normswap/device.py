"""Where normswap's tensors live: the ``--device`` choice, a model's input device, accelerate-offloaded
parameters, and like-for-like float32 (TF32 off) while normswap measures.

Every tensor the pipeline creates takes its device from the tensors it will meet; the helpers here say
which device that is for a model placed whole on one device, spread by ``device_map``, or partly
offloaded by accelerate (parameters on the ``meta`` device behind an ``AlignDevicesHook`` that reads them
from a weights map before each forward).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from normswap.errors import NormswapError

DEVICE_CHOICES = "auto, cpu, cuda or cuda:N"


def resolve_device(spec: str | None) -> torch.device:
    """The torch device named by a ``--device`` value.

    Args:
        spec: ``"auto"`` (or None: the first CUDA GPU when torch sees one, else the CPU), ``"cpu"``,
            ``"cuda"`` (the current CUDA device) or ``"cuda:N"``.

    Raises:
        NormswapError: an unknown device, or a CUDA device this torch does not see (one line).
    """
    spec = (spec or "auto").strip().lower()
    if spec == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
    try:
        device = torch.device(spec)
    except RuntimeError:
        raise NormswapError(f"--device {spec}: unknown device ({DEVICE_CHOICES})") from None
    if device.type == "cpu":
        return torch.device("cpu")
    if device.type != "cuda":
        raise NormswapError(f"--device {spec}: unsupported device ({DEVICE_CHOICES})")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise NormswapError(f"--device {spec}: this torch sees no CUDA device")
    index = torch.cuda.current_device() if device.index is None else device.index
    if index >= count:
        raise NormswapError(f"--device {spec}: no such CUDA device (this torch sees cuda:0..{count - 1})")
    return torch.device("cuda", index)


def _hooks(module: nn.Module) -> list:
    """The accelerate hooks attached to ``module`` (a ``SequentialHook`` unpacked), or []."""
    hook = getattr(module, "_hf_hook", None)
    if hook is None:
        return []
    return list(getattr(hook, "hooks", None) or [hook])


def execution_device(module: nn.Module) -> torch.device | None:
    """The device accelerate runs ``module`` on (its hook's ``execution_device``), or None without a hook."""
    for hook in _hooks(module):
        device = getattr(hook, "execution_device", None)
        if device is not None:
            return torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    return None


def model_device(model: nn.Module) -> torch.device:
    """The device a model's input ids go to.

    The device of the input embedding's weight (where accelerate placed it, or its hook's execution
    device when that weight is offloaded), else the first parameter not on ``meta``, else the CPU.
    """
    embed = None
    if hasattr(model, "get_input_embeddings"):
        with contextlib.suppress(Exception):
            embed = model.get_input_embeddings()
    if isinstance(embed, nn.Module):
        weight = getattr(embed, "weight", None)
        if isinstance(weight, torch.Tensor) and weight.device.type != "meta":
            return weight.device
        device = execution_device(embed)
        if device is not None:
            return device
    for p in model.parameters():
        if p.device.type != "meta":
            return p.device
    return torch.device("cpu")


def placement(model: nn.Module) -> dict[str, str | int] | None:
    """Where ``model``'s weights live, as a transformers ``device_map`` that reloads them in the same place.

    Returns:
        ``None`` for a model wholly on the CPU; accelerate's ``hf_device_map`` (``{"model.embed_tokens": 0,
        "lm_head": "cpu", ...}``: accelerator indices or device names) for a model it placed; else
        ``{"": "cuda:0"}``, the device of the model's input embedding (``model_device``).
    """
    mapped = getattr(model, "hf_device_map", None)
    if mapped and set(mapped) != {""}:
        return {name: d if isinstance(d, int) else str(d) for name, d in mapped.items()}
    devices = {p.device for p in model.parameters() if p.device.type != "meta"}
    if not devices or devices == {torch.device("cpu")}:
        return None
    return {"": str(model_device(model))}


def offloaded(model: nn.Module) -> dict[str, str]:
    """Parameters and buffers that accelerate offloaded: qualified name -> owning module name.

    Such a tensor is on the ``meta`` device and its value lives in the weights map of the owning module's
    hook (CPU memory or files in the offload folder). Empty for a model with every tensor on a device.
    """
    found = {}
    for mod_name, module in model.named_modules():
        tensors = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
        for name, t in tensors:
            if t.device.type == "meta":
                found[f"{mod_name}.{name}" if mod_name else name] = mod_name
    return found


def carry_hook(original: nn.Module, replacement: nn.Module) -> None:
    """Give ``replacement`` the accelerate hook of the module it replaces, if any.

    A module placed by ``device_map`` may carry an ``AlignDevicesHook`` that moves its inputs to its
    execution device (and its outputs back); a swapped-in module without it would meet inputs on another
    device.
    """
    hook = getattr(original, "_hf_hook", None)
    if hook is not None:
        from accelerate.hooks import add_hook_to_module

        add_hook_to_module(replacement, hook)


def refuse_offloaded(model: nn.Module) -> None:
    """Refuse, in one line naming the module, a model with parameters accelerate offloaded.

    An offloaded tensor (``device_map`` with ``"disk"``, or ``"cpu"`` next to GPUs) is a ``meta`` tensor
    that accelerate's hook replaces by a fresh copy on every forward: normswap could neither trace its uses
    nor fold into it in place, and would silently leave norms unfolded (field case C8).

    Raises:
        NormswapError: naming the first offloaded module and how many tensors are offloaded.
    """
    found = offloaded(model)
    if found:
        first = next(iter(found.values())) or "the model"
        raise NormswapError(
            f"{first}: parameters offloaded by accelerate ({len(found)} tensors on the meta device behind "
            "hooks); normswap cannot fold into offloaded storage: load the model with every layer on a "
            'device (a device_map without "disk" or "cpu" offload, or --device)'
        )


def offload_value(module: nn.Module, name: str) -> torch.Tensor | None:
    """The value of ``module``'s own tensor ``name`` as accelerate's hook would load it, or None.

    Read from the weights map of the module's ``AlignDevicesHook`` (a CPU tensor, or a memory map of the
    offload folder's file); None when the module has no such hook or the map lacks the name.
    """
    for hook in _hooks(module):
        weights = getattr(hook, "weights_map", None)
        if weights is not None and getattr(hook, "offload", False):
            with contextlib.suppress(KeyError):
                return torch.as_tensor(weights[name])
    return None


def cpu_float64_copy(module: nn.Module) -> nn.Module:
    """A float64 CPU copy of a small module (a norm candidate), without accelerate hooks.

    Parameters and buffers on ``meta`` are read from the module's offload map. The copy's forward is the
    module's own (hooks removed), so it runs entirely on the CPU in float64 wherever the model lives.

    Raises:
        ValueError: a tensor is on ``meta`` and no offload map holds its value.
    """
    import copy

    clone = copy.copy(module)  # shallow: the model's tensors are not duplicated on their device
    clone._parameters = dict(module._parameters)
    clone._buffers = dict(module._buffers)
    clone._modules = dict(module._modules)
    if "_hf_hook" in vars(clone):  # accelerate's forward wrapper: run the module's own forward instead
        del clone._hf_hook
        clone.forward = vars(clone).pop("_old_forward", type(module).forward.__get__(clone))
    forward = vars(clone).get("forward")
    if getattr(forward, "__self__", None) is module:  # an instance-level forward bound to the original
        clone.forward = forward.__func__.__get__(clone)
    with torch.no_grad():
        for store in (clone._parameters, clone._buffers):
            for name, t in store.items():
                if t is None:
                    continue
                if t.device.type == "meta":
                    value = offload_value(module, name)
                    if value is None:
                        raise ValueError(f"{name} is on the meta device and no offload map holds it")
                    t = value
                dtype = torch.float64 if t.is_floating_point() else t.dtype
                value = t.detach().to("cpu", dtype, copy=True)
                is_param = store is clone._parameters
                store[name] = nn.Parameter(value, requires_grad=False) if is_param else value
    return clone


@contextlib.contextmanager
def exact_float32() -> Iterator[None]:
    """Float32 matmuls and convolutions in full float32 (TF32 off) inside the block; settings restored.

    On Ampere and later GPUs torch may run float32 matmuls in TF32 (10-bit mantissa), which moves float32
    logits by ~1e-3 and makes a float32 comparison measure TF32 noise rather than the conversion. Sets
    ``torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False`` and
    ``torch.set_float32_matmul_precision("highest")``; when the caller configured TF32 through torch's
    newer ``fp32_precision`` attributes (reading the legacy flags then raises), sets those to ``"ieee"``
    instead (cuBLAS matmul, cuDNN conv and rnn). Harmless on the CPU. Usable as a decorator.
    """
    matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    try:
        saved = (matmul.allow_tf32, cudnn.allow_tf32, torch.get_float32_matmul_precision())
    except RuntimeError:  # TF32 set through the fp32_precision API: mixing the two APIs raises
        saved = None
    if saved is not None:
        try:
            matmul.allow_tf32 = cudnn.allow_tf32 = False
            torch.set_float32_matmul_precision("highest")
            yield
        finally:  # allow_tf32 first: setting it also sets the precision, which then gets its own value
            matmul.allow_tf32, cudnn.allow_tf32 = saved[0], saved[1]
            torch.set_float32_matmul_precision(saved[2])
        return
    targets = [matmul, getattr(cudnn, "conv", None), getattr(cudnn, "rnn", None)]
    targets = [t for t in targets if t is not None and hasattr(t, "fp32_precision")]
    before = [t.fp32_precision for t in targets]
    try:
        for t in targets:
            t.fp32_precision = "ieee"
        yield
    finally:
        for t, value in zip(targets, before, strict=True):
            t.fp32_precision = value
