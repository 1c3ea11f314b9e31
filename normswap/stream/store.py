"""The weights of a streamed model as ``normswap.convert``'s store: its steps, with the large weights on disk.

In memory, centering (``--norm rmsnorm``), the rotation and the fold change Parameters in place. A streamed
model holds its large weights on disk, so ``ShardStore`` gives ``normswap.convert.convert`` other hooks
(``normswap.convert.Store``); the steps, their order and their arithmetic are the in-memory ones:

* the plans read a released weight's values from its shard (``read``; by rows for a stack of experts,
  ``read_rows``), and an untied Parameter is a placeholder read from the tensor it was tied to (``copy``);
* centering and the rotation express each change of a weight on disk as a *transform*
  (``Streamed.transform``): a function of the tensor's values alone, applied every time the values are read
  (each streamed forward, the plans' reads, the written output). The same function on the same values gives
  the same bytes as in memory. The resident norm parameters and biases change at once, as in memory;
* the fold is not applied here: ``fold`` keeps the plan of the sites it must write (``writes``), and
  ``normswap.stream.plan`` applies its records (``normswap.fold.FoldChange``) as each shard is written;
* a forward that reads a weight outside its module becomes one line (``run``), and the memory a step freed
  is given back before the next (``settle``).
"""

from __future__ import annotations

import copy
import dataclasses

import torch

from normswap.convert import Store
from normswap.device import exact_float32
from normswap.errors import NormswapError
from normswap.stream.model import Streamed, StreamedParameter, is_released


def _read(target: torch.Tensor) -> torch.Tensor:
    return copy.deepcopy(target) if isinstance(target, StreamedParameter) and is_released(target) else target


class ShardStore(Store):
    """``normswap.convert.Store`` for ``streamed`` (``stream.model.build``), whose source is named ``source``
    in its errors. After ``convert``, ``writes`` is the fold plan the shards are written with
    (``stream.plan.tensor_plans``): the sites the rotation did not fold."""

    def __init__(self, streamed: Streamed, source: str):
        self.streamed = streamed
        self.source = source
        self.copy = streamed.copy
        self.writes = None

    def read(self, name: str) -> torch.Tensor:
        """Parameter ``name`` with its values (read from the checkpoint when released)."""
        return _read(self.streamed.model.get_parameter(name))

    def read_rows(self, name: str) -> torch.Tensor:
        """As ``read``, but a parameter read by rows as it is (``fold.input_peaks`` reads it one expert at
        a time)."""
        p = self.streamed.model.get_parameter(name)
        return p if isinstance(p, StreamedParameter) and p.by_rows() else _read(p)

    def run(self, step):
        """``step()``; a forward that reads a streamed weight outside its module becomes one clear line.

        Raises:
            NormswapError: such a read (a ``RuntimeError`` about a storage of size 0).
        """
        return guarded(step, self.source)

    def settle(self) -> None:
        release_memory()

    @exact_float32()
    def center(self, model, walk, inputs, *, untie: bool, add_biases: bool):
        """``normswap.center.center``: the same plan and arithmetic, each change of a streamed weight a
        transform (``prepare``'s ``defer``)."""
        from normswap.center import commit, plan_centering, prepare
        from normswap.center.inputs import describe

        streamed = self.streamed

        def defer(target: torch.Tensor, op):
            if not isinstance(target, StreamedParameter):
                return None  # a tensor the conversion made (in memory): changed at once
            return lambda: streamed.transform(target, op)

        plan = plan_centering(model, walk, inputs, untie=untie, add_biases=add_biases)
        if plan.result.note is None:
            actions = prepare(model, plan, copy=streamed.copy, defer=defer, read=_read)
            plan.result.inputs = describe(model, plan)  # as in memory: before the commit
            commit(model, walk, plan, actions)
        return plan.result

    def fold_and_rotate(self, model, plan, sites, folding, kind: str, seed: int, matrices=None):
        """``normswap.rotate.fold_and_rotate``: the same changes (``rotate.plan_changes``) and float64
        arithmetic per tensor, each weight on disk changed as it is read (a resident one at once).

        Raises:
            normswap.rotate.RotationError: a resident tensor would leave its dtype's range (nothing changed);
                a weight on disk raises it as it is written (``stream.plan.make_tensor``), in one line.
        """
        from normswap.rotate import fold_and_rotate

        streamed = self.streamed

        def defer(target: torch.Tensor, op):
            if not (isinstance(target, StreamedParameter) and is_released(target)):
                return None  # resident (a norm scale, a bias) or made by the conversion: changed at once
            return lambda: streamed.transform(target, op)

        return fold_and_rotate(model, plan, sites, folding, kind, seed, defer=defer, read=_read,
                               matrices=matrices)  # fmt: skip

    def fold(self, model, walk, folding, scales, skip) -> int:
        """Keep the plan of the sites to fold as the shards are written (``writes``: ``folding``'s sites but
        ``skip``), each marked folded; no affine site is folded (a streamed model is a causal LM)."""
        self.writes = dataclasses.replace(folding, sites=[s for s in folding.sites if s.name not in skip])
        for site in folding.sites:
            site.folded = True
        return 0


def guarded(step, source: str):
    """``step()``; a forward that reads a streamed weight outside its module becomes one clear line."""
    try:
        return step()
    except RuntimeError as error:
        if "storage" in str(error) and "size 0" in str(error):
            raise NormswapError(
                f"{source}: cannot be streamed: a weight is read outside the module that holds it "
                f"({str(error).splitlines()[0]})"
            ) from error
        raise


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
