"""The recording of one forward: every torch op as a graph of tensor versions and their uses.

``walk`` follows each norm's output forward; centering and the rotation also need the way back, from a
norm's input to whatever wrote it, and then forward again to every other reader of those writes. So the
walk's traced forward (``normswap.walk.trace``) can also drive a ``Recorder``: each op's output becomes a
``Node`` (op, arguments, executing module, the tensor versions it read) and each tensor version gets its
list of uses. An in-place op gives its first argument a new version (``Key = (id(tensor), version)``).

Which modules are norms is known only after that forward (the walk probes its candidates then), so every
module call is recorded too, and ``finish`` turns the calls of the norms into one node each: a norm module's
node has its input as its operand, and the ops inside it are dropped from the graph. Ops that read only
metadata (``walk.METADATA_OPS``: shapes, dtypes; the tracer does not pass them on) are not uses.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

Key = tuple[int, int]  # (id(tensor), version): in-place ops give a tensor a new version
ZEROS = {"zeros", "zeros_like", "new_zeros"}  # recorded as a "zeros" node (``center.ops.ZEROS``)


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
    calls: tuple[int, ...] = ()  # the module calls it ran inside (indices into ``Recorder.calls``)


@dataclass(eq=False)
class _Call:
    """One module call: its first argument's version (if a tensor) and its output's (if a tensor)."""

    module: int  # id of the module
    input: Key | None
    outer: tuple[int, ...]  # the calls it ran inside
    output: torch.Tensor | None = None
    key: Key | None = None
    order: int = 0


class Recorder:
    """Records every torch op of one forward as ``Node``s, with the uses of each tensor version.

    ``normswap.walk`` calls ``call``, ``returned`` and ``op`` as the forward runs, then ``finish`` with the
    norms' module names; only then are these attributes complete:

    Attributes:
        params / tensors / owners: id -> qualified name, qualified name -> Parameter, and qualified name
            -> every ``(module, attribute)`` holding it, for all parameters of the model (the walk's).
        buffers: id -> qualified name of every buffer.
        nodes: the node that made each tensor version.
        uses: for each tensor version, the ``Node``s that read it, ``("norm", site)`` for a norm module's
            input and ``("output", None)`` for a model output.
        norm_inputs: for each norm site, the tensor versions it was called on.
    """

    def __init__(self, params: dict[int, str], tensors: dict[str, torch.Tensor], owners: dict,
                 buffers: dict[int, str], modules: dict[str, int]):  # fmt: skip
        self.params, self.tensors, self.owners, self.buffers = params, tensors, owners, buffers
        self.modules = modules  # module name (every alias) -> id of the module
        self.version: dict[int, int] = {}
        self.nodes: dict[Key, Node] = {}
        self.uses: dict[Key, list] = defaultdict(list)
        self.norm_inputs: dict[str, list[Key]] = defaultdict(list)
        self.calls: list[_Call] = []
        self.keep: list[torch.Tensor] = []  # holds every seen tensor alive so ids are not reused
        self._open: list[int] = []  # the calls running now, outermost first
        self._made: list[Node | int] = []  # op nodes and returned calls (their index), in order
        self.count = 0

    def key(self, t: torch.Tensor) -> Key:
        return (id(t), self.version.get(id(t), 0))

    # -- as the forward runs ------------------------------------------------------------------------------
    def call(self, module, args) -> None:
        """A module is called with positional ``args``; its first, if a tensor, is the input of a norm."""
        k = None
        if args and isinstance(args[0], torch.Tensor):
            k = self.key(args[0])
            self.keep.append(args[0])
            self.uses[k].append(len(self.calls))  # a placeholder: a norm's use, or nothing (``finish``)
        self.calls.append(_Call(id(module), k, tuple(self._open)))
        self._open.append(len(self.calls) - 1)

    def returned(self, output) -> None:
        """The innermost running module returned ``output``."""
        if not self._open:
            return
        index = self._open.pop()
        if isinstance(output, torch.Tensor):
            call = self.calls[index]
            self.keep.append(output)
            self.count += 1
            call.output, call.key, call.order = output, self.key(output), self.count
            self._made.append(index)

    def op(self, func, name: str, args: tuple, kwargs: dict, out, module: str, metadata: bool) -> None:
        """``out = func(*args, **kwargs)`` ran in ``module``; ``metadata``: it read no values."""
        calls = tuple(self._open)
        if name in ZEROS and isinstance(out, torch.Tensor):  # the start of an accumulation: no input read
            self.count += 1
            self.keep.append(out)
            k = self.key(out)
            node = Node("zeros", func, (), {}, module, {}, out, None, self.count, key=k, calls=calls)
            self._made.append(node)
            return
        if metadata:
            return
        operands = {i: self.key(a) for i, a in enumerate(args) if isinstance(a, torch.Tensor)}
        operands.update({k: self.key(a) for k, a in kwargs.items() if isinstance(a, torch.Tensor)})
        flat, _ = tree_flatten((args, kwargs))
        inputs = [a for a in flat if isinstance(a, torch.Tensor)]
        input_keys = [self.key(a) for a in inputs]
        self.keep.extend(inputs)
        mutated = bool(args) and isinstance(args[0], torch.Tensor) and _mutates(name)
        results = list(out) if isinstance(out, tuple | list) else [out]
        if not mutated and any(o is a for o in results for a in inputs):
            return  # an alias of an input (x.contiguous() of a contiguous x): no new value
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
            node = Node(name, func, tuple(args), dict(kwargs), module, operands, o, piece, self.count, key=k,
                        calls=calls)  # fmt: skip
            self._made.append(node)
            self.keep.append(o)
            made.append(node)
        for k in input_keys:  # an op with no tensor result (x.tolist()) still reads its inputs
            self.uses[k].extend(made or [Node(name, func, (), {}, module, {}, None, calls=calls)])

    def output(self, output) -> None:
        """Mark every tensor of the model's ``output`` as used by ``("output", None)``."""
        flat, _ = tree_flatten(output.to_tuple() if hasattr(output, "to_tuple") else output)
        for t in flat:
            if isinstance(t, torch.Tensor):
                self.uses[self.key(t)].append(("output", None))

    # -- after it --------------------------------------------------------------------------------------------
    def finish(self, site_names: list[str]) -> Recorder:
        """Make the norms ``site_names`` (module names) one node each: the outermost call of a norm becomes
        a node whose operand is its input, and ``("norm", site)`` a use of that input; the ops run inside a
        norm call are dropped, and every other module call leaves no trace. Returns this recorder."""
        site_of = {self.modules[n]: n for n in site_names if n in self.modules}
        inside = {i for i, c in enumerate(self.calls) if c.module in site_of}  # calls of a norm

        def kept(calls: tuple[int, ...]) -> bool:
            return not any(i in inside for i in calls)

        norm_calls = {
            i for i in inside if kept(self.calls[i].outer) and self.calls[i].input is not None
        }  # the outermost calls of a norm on a tensor
        for uses in self.uses.values():
            resolved = []
            for use in uses:
                if isinstance(use, int):  # a module call's input
                    if use in norm_calls:
                        resolved.append(("norm", site_of[self.calls[use].module]))
                elif not isinstance(use, Node) or kept(use.calls):
                    resolved.append(use)
            uses[:] = resolved
        for k in [k for k, uses in self.uses.items() if not uses]:  # read only inside a norm
            del self.uses[k]
        for i in sorted(norm_calls):
            self.norm_inputs[site_of[self.calls[i].module]].append(self.calls[i].input)
        for made in self._made:
            if isinstance(made, Node):
                if kept(made.calls):
                    self.nodes[made.key] = made
            elif made in norm_calls:
                call = self.calls[made]
                site = site_of[call.module]
                self.nodes[call.key] = Node("norm", None, (), {}, site, {0: call.input}, call.output, None,
                                            call.order, site, call.key)  # fmt: skip
        self._made, self.calls = [], []
        return self


def _mutates(name: str) -> bool:
    return (
        name == "__setitem__"
        or (name.startswith("__i") and name.endswith("__"))
        or (name.endswith("_") and not name.startswith("_") and name != "requires_grad_")
    )
