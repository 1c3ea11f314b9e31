"""The in-place steps of the in-memory pipeline that change weights before the fold, on a streamed model.

In memory, centering (``--norm rmsnorm``, ``normswap.center``) rewrites weights in place. A streamed model
holds its large weights on disk, so each such change becomes a *transform* of a parameter
(``Streamed.transform``): a function of the tensor's values alone, applied every time the values are read
(each streamed forward, the fold plan's reads, the written output). The same function on the same values
gives the same bytes as in memory; everything else (which tensors change, the untied copies, the added
biases, the config flags, the walk's records) is the in-memory code itself, unchanged:

* ``center``: ``normswap.center.plan_centering`` records one streamed forward; ``prepare`` and ``commit``
  run with ``Streamed.copy`` for untied holders and ``Streamed.transform`` for every change of values.

Another weight-changing step plugs in the same way: plan on the streamed model, then express each change of
a tensor as ``Streamed.transform(parameter, op)``, with ``op`` a function of that tensor's values (a
rotation ``W -> W Q`` is one).
"""

from __future__ import annotations

import copy

import torch

from normswap.device import exact_float32
from normswap.stream.model import Streamed, StreamedParameter, is_released


def _defer(streamed: Streamed):
    def defer(target: torch.Tensor, op):
        if not isinstance(target, StreamedParameter):
            return None  # a tensor the conversion made (in memory): changed at once
        return lambda: streamed.transform(target, op)

    return defer


def _read(target: torch.Tensor) -> torch.Tensor:
    return copy.deepcopy(target) if isinstance(target, StreamedParameter) and is_released(target) else target


@exact_float32()
def center(streamed: Streamed, walk, inputs, *, untie: bool = True):
    """``normswap.center.center`` on a streamed model: the same plan, the same arithmetic, as transforms.

    Args:
        streamed: the streamed model (``stream.model.build``), not yet folded.
        walk: ``normswap.walk.walk`` of it.
        inputs: the recording forward's ids (the walk's: the plan follows the dataflow, not the length).
        untie: allow untying a holder of a written parameter.

    Returns:
        ``normswap.center.CenterResult``.

    Raises:
        normswap.center.CenteringError: as ``center`` (nothing changed).
    """
    from normswap.center import commit, plan_centering, prepare
    from normswap.center.inputs import describe

    plan = plan_centering(streamed.model, walk, inputs, untie=untie, add_biases=True)
    if plan.result.note is None:
        actions = prepare(streamed.model, plan, copy=streamed.copy, defer=_defer(streamed), read=_read)
        plan.result.inputs = describe(streamed.model, plan)  # as in memory: before the commit
        commit(streamed.model, walk, plan, actions)
    return plan.result
