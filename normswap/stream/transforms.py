"""The in-place steps of the in-memory pipeline that change weights before the fold, on a streamed model.

In memory, centering (``--norm rmsnorm``, ``normswap.center``) rewrites weights in place. A streamed model
holds its large weights on disk, so each such change becomes a *transform* of a parameter
(``Streamed.transform``): a function of the tensor's values alone, applied every time the values are read
(each streamed forward, the fold plan's reads, the written output). The same function on the same values
gives the same bytes as in memory; everything else (which tensors change, the untied copies, the added
biases, the config flags, the walk's records) is the in-memory code itself, unchanged:

* ``center``: ``normswap.center.plan_centering`` records one streamed forward; ``prepare`` and ``commit``
  run with ``Streamed.copy`` for untied holders and ``Streamed.transform`` for every change of values;
* ``rotate``: ``normswap.rotate.fold_and_rotate`` (its plan from ``normswap.rotate.plan_rotation`` on the
  streamed model): every weight on disk gets its ``Change.op`` (fold, ``W -> W Q``, per-head ``H``, in
  float64, rounded once) as a transform, applied to the copy read as each output tensor is written (never
  to the input file); the resident norm parameters and biases change at once, as in memory.

Another weight-changing step plugs in the same way: plan on the streamed model, then express each change of
a tensor as ``Streamed.transform(parameter, op)``, with ``op`` a function of that tensor's values.
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


def _defer_released(streamed: Streamed):
    def defer(target: torch.Tensor, op):
        if not (isinstance(target, StreamedParameter) and is_released(target)):
            return None  # resident (a norm scale, a bias) or made by the conversion: changed at once
        return lambda: streamed.transform(target, op)

    return defer


def rotate(streamed: Streamed, plan, sites, folding, kind: str, seed: int):
    """``normswap.rotate.fold_and_rotate`` on a streamed model: the same changes (``rotate.plan_changes``),
    the same float64 arithmetic per tensor, each weight on disk changed as it is read.

    Args:
        streamed: the streamed model, centered and untied as the fold plan needs, no norm folded.
        plan: ``normswap.rotate.plan_rotation`` of it (before centering, as in memory), checked by
            ``check_folding``.
        sites: the walk's sites.
        folding: ``normswap.fold.plan`` of it; the stream norms it folds fold in the rotation's pass, so
            ``stream.plan.tensor_plans`` must be given the other sites only.
        kind, seed: the matrices'.

    Returns:
        ``normswap.rotate.Rotation``.

    Raises:
        normswap.rotate.RotationError: a resident tensor would leave its dtype's range (nothing changed); a
            weight on disk raises it as it is written (``stream.plan.make_tensor``), in one line.
    """
    from normswap.rotate import fold_and_rotate

    return fold_and_rotate(streamed.model, plan, sites, folding, kind, seed, defer=_defer_released(streamed),
                           read=_read)  # fmt: skip
