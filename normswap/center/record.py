"""The recording forward: every torch op of one forward, as a graph of tensor versions and their uses.

``walk`` follows each norm's output forward; centering also needs the way back, from each LayerNorm's
input to whatever wrote it, and then forward again to every other reader of those writes. So one forward
under a ``TorchFunctionMode`` records each op's output as a ``Node`` (op, arguments, executing module,
the tensor versions it read) and, for each tensor version, every use. An in-place op gives its first
argument a new version (``Key = (id(tensor), version)``). A norm module is one node whose operand is its
input: the ops inside it are not recorded. Ops that read only metadata (``walk.METADATA_OPS``: shapes,
dtypes, ``zeros_like``) are not uses.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from normswap.walk import METADATA_OPS, func_name, run_example

Key = tuple[int, int]  # (id(tensor), version): in-place ops give a tensor a new version


@dataclass(eq=False)
class Node:
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


class Recorder(TorchFunctionMode):
    """Records every torch op of one forward as ``Node``s, with the uses of each tensor version.

    Attributes:
        params / tensors / owners: id -> qualified name, qualified name -> Parameter, and qualified name
            -> every ``(module, attribute)`` holding it, for all parameters of the model.
        buffers: id -> qualified name of every buffer.
        nodes: the node that made each tensor version.
        uses: for each tensor version, the ``Node``s that read it, ``("norm", site)`` for a norm module's
            input and ``("output", None)`` for a model output.
        norm_inputs: for each norm site, the tensor versions it was called on.
    """

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
        self.nodes: dict[Key, Node] = {}
        self.uses: dict[Key, list] = defaultdict(list)
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
            self.nodes[k] = Node("norm", None, (), {}, site, operands, output, None, self.count, site, k)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.inside:
            return out
        name = func_name(func)
        if name in ZEROS and isinstance(out, torch.Tensor):  # the start of an accumulation: no input read
            self.count += 1
            self.keep.append(out)
            k = self.key(out)
            self.nodes[k] = Node("zeros", func, (), {}, self.stack[-1] if self.stack else "", {}, out, None,
                                 self.count, key=k)  # fmt: skip
            return out
        if name in METADATA_OPS:
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
            node = Node(name, func, tuple(args), dict(kwargs), module, operands, o, piece, self.count, key=k)
            self.nodes[k] = node
            self.keep.append(o)
            made.append(node)
        for k in input_keys:  # an op with no tensor result (x.tolist()) still reads its inputs
            self.uses[k].extend(made or [Node(name, func, (), {}, module, {}, None)])
        return out


ZEROS = {"zeros", "zeros_like", "new_zeros"}  # recorded as a "zeros" node (``ops.ZEROS``)


def _mutates(name: str) -> bool:
    return (
        name == "__setitem__"
        or (name.startswith("__i") and name.endswith("__"))
        or (name.endswith("_") and not name.startswith("_") and name != "requires_grad_")
    )


def record(model: nn.Module, site_names: list[str], inputs=None) -> Recorder:
    """Run ``walk.run_example`` (eval mode, no grad) under a ``Recorder`` hooked on every module.

    Args:
        model: the model; its modes are restored and the hooks removed afterwards.
        site_names: module names of the norms (each recorded as one node).
        inputs: the walk's inputs (ids, ``walk.ExampleInputs``), or None for the walk's default.

    Returns:
        The recorder, with every tensor of the model's output marked as used by ``("output", None)``.
    """
    recorder = Recorder(model, site_names)
    handles = [
        nn.modules.module.register_module_forward_pre_hook(recorder.pre_hook),
        nn.modules.module.register_module_forward_hook(recorder.post_hook),
    ]
    try:
        with recorder:
            output = run_example(model, inputs)
    finally:
        for h in handles:
            h.remove()
    flat, _ = tree_flatten(output.to_tuple() if hasattr(output, "to_tuple") else output)
    for t in flat:
        if isinstance(t, torch.Tensor):
            recorder.uses[recorder.key(t)].append(("output", None))
    return recorder
