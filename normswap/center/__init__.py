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
LayerNorms, where the rows of the producing projection are centered head by head. Formulas and the
measured results: docs/CENTERING.md.

Nothing here reads class or parameter names. The steps, one module each:

* (``normswap.recording``: the walk's forward records every torch op and every use of each tensor
  version;)
* ``writers``: from each LayerNorm's input, back through sums and value-preserving ops to the writers
  (``ops`` says what each recorded op means);
* ``plan``: which features are normalized together (recorded ops replayed on feature indices), the
  ``CenterResult``; ``readers`` checks that the centered tensors are read by nothing but LayerNorms and
  finds the holders to untie; ``flags`` finds config flags that add the consumer biases a fold needs;
* ``commit``: ``prepare`` allocates every new tensor (``rewrite``: centered weights, rewritten tables)
  without touching the model, then ``commit`` only assigns, so a refusal (``CenteringError``) or an error
  before the commit leaves the model exactly as it was;
* ``biased``: ``BiasedRMSNorm``, for a norm whose bias no consumer can take;
* ``inputs``: what the centered model expects as ``inputs_embeds`` (``centering.json``), and ``apply``.
"""

from __future__ import annotations

from torch import nn

from normswap.center.commit import commit, prepare
from normswap.center.errors import CenteringError
from normswap.center.inputs import describe
from normswap.center.plan import CenterResult, plan_centering
from normswap.device import exact_float32
from normswap.kernels.biased import BiasedRMSNorm
from normswap.walk import Walk

__all__ = ["BiasedRMSNorm", "CenterResult", "CenteringError", "center", "plan_centering"]


@exact_float32()
def center(
    model: nn.Module,
    walk: Walk,
    inputs=None,
    *,
    untie: bool = True,
    add_biases: bool = True,
    recorded=None,
) -> CenterResult:
    """Make every LayerNorm input of ``model`` zero-mean without changing its function, in place.

    Afterwards each LayerNorm site of ``walk`` has ``kind == "rmsnorm"`` (it computes the same as an
    RMSNorm with its weight and bias), biases that config flags can carry are added and recorded on the
    consumers (so ``fold`` absorbs the norm's bias), and shared parameters are untied in the walk's
    records; ``fold`` and ``swap.swap_norms`` then finish the conversion. A model without LayerNorm is
    left alone (``result.note``).

    Args:
        model: any module with float parameters.
        walk: ``normswap.walk.walk(model, inputs)`` of the same model, not yet folded.
        inputs: the recording forward's inputs (as ``walk``: ids, ``walk.ExampleInputs`` or None).
        untie: allow giving a holder of a written parameter (``lm_head`` tied to the embedding) its own
            copy; with False such a model is refused.
        add_biases: allow setting config flags that add zero biases to consumers.
        recorded: the recording forward of this model as it is (``recording.Recorder``: the walk's or the
            rotation plan's), or None: ``walk.recording``, else one is recorded.

    Returns:
        A ``CenterResult``.

    Raises:
        CenteringError: conversion would not be exact (post-LN model, positions from a buffer, a
            non-linear producer, a stream also read by an RMSNorm or returned, untying disabled); the
            model is unchanged. Any other error before the commit also leaves it unchanged.
    """
    plan = plan_centering(model, walk, inputs, untie=untie, add_biases=add_biases, recorded=recorded)
    if plan.result.note is None:
        actions = prepare(model, plan)
        plan.result.inputs = describe(model, plan)  # before the commit: the embedding norm's own parameters
        commit(model, walk, plan, actions)
    return plan.result
