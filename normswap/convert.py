"""The conversion pipeline, in place: walk -> plan -> untie -> fold -> swap."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from normswap.errors import NormswapError
from normswap.fold import fold_site, plan, scale_and_shift, untie_checked
from normswap.sites import NormSite
from normswap.swap import swap_norms
from normswap.walk import ExampleInputs, Walk, walk

NORM_CHOICES = ("keep", "rmsnorm")
KEEP_VS_CENTER = (
    "norm='rmsnorm' centers the residual stream, which moves every hidden state by its mean: it cannot keep "
    "the hidden states (keep_hidden_states=True)"
)
log = logging.getLogger("normswap")


@dataclass
class ConvertReport:
    """What ``convert`` did.

    Attributes:
        model: the model's name or path (``config._name_or_path``) or class name.
        norm: the requested target kind (``"keep"`` or ``"rmsnorm"``).
        norms_found / norms_folded / norms_swapped: counts over ``sites``.
        sites: every norm found, with consumers, what was done and why not.
        untied: qualified names of parameters given their own storage before folding.
        untie_bytes: extra bytes those copies cost.
        untouched: 2-D+ parameters no op used in the trace (listed for the user to judge).
        check: the check result (``CheckResult.to_dict()``) when the caller ran one.
        keep_hidden_states: whether the conversion kept every hidden state (``convert``'s option).
        centering: what centering did (``norm="rmsnorm"``: ``CenterResult.to_dict()``, with ``inputs``, the
            ``inputs_embeds`` transform), or None.
    """

    model: str
    norm: str
    norms_found: int
    norms_folded: int
    norms_swapped: int
    sites: list[NormSite]
    untied: list[str] = field(default_factory=list)
    untie_bytes: int = 0
    untouched: list[str] = field(default_factory=list)
    check: dict[str, Any] | None = None
    keep_hidden_states: bool = False
    centering: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "norm": self.norm,
            "norms_found": self.norms_found,
            "norms_folded": self.norms_folded,
            "norms_swapped": self.norms_swapped,
            "untied": list(self.untied),
            "untie_bytes": self.untie_bytes,
            "untouched": list(self.untouched),
            "sites": [s.to_dict() for s in self.sites],
            "keep_hidden_states": self.keep_hidden_states,
            "centering": self.centering,
            "check": self.check,
        }


def stream_transform(report: ConvertReport | dict):
    """The change ``report``'s conversion made to the residual stream by design, for ``check.compare``
    (``normswap.check.contract.StreamTransform``), or None: centered after ``norm="rmsnorm"`` (a rewritten
    embedding table's norm input excepted)."""
    from normswap.center.inputs import FILE
    from normswap.check.contract import centered

    data = report.to_dict() if hasattr(report, "to_dict") else report
    centering = data.get("centering")
    if not centering:
        return None
    rewritten = [t.split(" -> ", 1)[1].split(" ", 1)[0] for t in centering.get("tables", [])]
    return centered(FILE, rewritten)


def _model_name(model: nn.Module) -> str:
    config = getattr(model, "config", None)
    return getattr(config, "_name_or_path", "") or type(model).__name__


def trace_inputs(input_ids: torch.Tensor | None = None, example_inputs=None):
    """The inputs the pipeline traces with: ``ExampleInputs`` when ``example_inputs`` is given, else the ids.

    Raises:
        ValueError: both are given.
        TypeError: ``example_inputs`` has none of the forms ``ExampleInputs.of`` accepts.
    """
    if example_inputs is None:
        return input_ids
    if input_ids is not None:
        raise ValueError("give either input_ids or example_inputs, not both")
    return ExampleInputs.of(example_inputs)


def no_norms_message(result: Walk) -> str:
    """``"no normalization module found"``, plus how many candidates failed to probe and the first error."""
    message = "no normalization module found"
    if result.probe_failures:
        name, error = next(iter(result.probe_failures.items()))
        count = len(result.probe_failures)
        message += f" ({count} candidate{'s' if count > 1 else ''} failed to probe; {name}: {error})"
    return message


def inspect(
    model: nn.Module,
    input_ids: torch.Tensor | None = None,
    *,
    example_inputs=None,
    untie: bool = True,
    keep_hidden_states: bool = False,
) -> list[NormSite]:
    """List the norms of ``model`` with their semantics, consumers and foldability; changes nothing.

    Each site's ``foldable`` and ``reason`` are the verdict ``convert`` reaches with the same options: the
    walk, then the same fold plan (shared parameters, the fold's range in the weights' dtype, untying
    ``lm_head`` and its proof, undone afterwards). See ``survey``.

    Args:
        model: any ``nn.Module``: a Hugging Face model, or one whose forward takes other inputs (give
            ``example_inputs`` then).
        input_ids: ``(batch, seq)`` int64 ids for the one traced forward (called as
            ``model(input_ids=...)``); default 2 x 16 fixed random ids below the config's vocabulary size.
        example_inputs: the traced forward's inputs instead, as ``torch.export`` takes them:
            ``(args_tuple, kwargs_dict)``; also a tuple of positional args, a dict of keyword args, a single
            tensor (one positional arg) or ``normswap.walk.ExampleInputs``. Called as
            ``model(*args, **kwargs)``, exactly as given.
        untie, keep_hidden_states: as in ``convert``.

    Returns:
        One ``NormSite`` per norm module, in execution order.

    Raises:
        ValueError: both ``input_ids`` and ``example_inputs`` given.
    """
    inputs = trace_inputs(input_ids, example_inputs)
    return survey(model, inputs, untie=untie, keep_hidden_states=keep_hidden_states).sites


@torch.inference_mode(False)
def survey(model: nn.Module, inputs=None, *, untie: bool = True, keep_hidden_states: bool = False) -> Walk:
    """The walk of ``model`` with the verdict ``convert`` would reach on each site, without converting.

    ``walk`` finds the norms and what reads them; ``fold.plan`` then blocks the sites convert blocks
    (a Parameter shared with another holder, a fold beyond the weights' dtype range, a tied consumer with
    untying disabled), and the untie proof runs as in ``convert`` (two short forwards where the model may
    read ``tie_word_embeddings``), after which the untied copies are dropped again: the model ends exactly
    as it was. Centering (``norm="rmsnorm"``) is not planned here: the verdicts are those of ``"keep"``.

    Args:
        model: the model (unchanged on return).
        inputs: the trace's inputs (``input_ids``, ``ExampleInputs`` or None; see ``walk``).
        untie, keep_hidden_states: as in ``convert``.
    """
    result = walk(model, inputs, keep_hidden_states=keep_hidden_states)
    if result.sites:
        folding = plan(model, result, untie=untie)
        untie_checked(model, folding, inputs).restore()
    return result


@torch.inference_mode(False)  # tensors made here become parameters: never inference tensors (C24)
def convert(
    model: nn.Module,
    *,
    norm: str = "keep",
    fold: bool = True,
    untie: bool = True,
    swap: bool = True,
    input_ids: torch.Tensor | None = None,
    example_inputs=None,
    traced: Walk | None = None,
    keep_hidden_states: bool = False,
) -> ConvertReport:
    """Fold every foldable norm into its consumers and swap every norm for a fused module, in place.

    Args:
        model: the model to convert (modified in place).
        norm: ``"keep"`` keeps each norm's kind; ``"rmsnorm"`` converts a pre-LN LayerNorm model into an
            equivalent RMSNorm model by centering the residual stream (SliceGPT, Ashkboos et al. 2024).
        fold: fold affine parameters into consumers where exact.
        untie: allow giving a tied consumer weight (``lm_head`` tied to the embedding) its own copy so the
            final norm can fold into it; with False such sites are swapped only and storage stays shared.
        swap: replace norms by fused modules.
        input_ids: ids for the trace (see ``inspect``).
        example_inputs: the trace's inputs for a forward that does not take ``input_ids`` (see ``inspect``);
            also used for the untie proof and the centering record.
        traced: a ``normswap.walk.walk(model, inputs)`` of this model taken just before (so a caller that
            needed the sites first, e.g. to record a reference, does not trace twice); walked here if None.
            With ``keep_hidden_states`` it must have been walked with ``keep_hidden_states=True`` too.
        keep_hidden_states: keep every hidden state the model returns (``output_hidden_states``, the base
            model's ``last_hidden_state``) the original's: a norm whose output is returned (the final norm) is
            not folded into the head, and centering, which moves every hidden state, is refused.

    Returns:
        A ``ConvertReport``. Every parameter it creates is an ordinary tensor, also when called inside
        ``torch.inference_mode()``: the converted model can be trained. After centering, give
        ``normswap.check.compare`` the stream transform ``stream_transform(report)``.

    Raises:
        ValueError: unknown ``norm``, both ``input_ids`` and ``example_inputs``, or ``norm="rmsnorm"`` with
            ``keep_hidden_states``.
        NormswapError: the model has no norm.
        normswap.center.CenteringError: ``norm="rmsnorm"`` on a model that cannot be converted exactly (the
            model is left unchanged).
    """
    if norm not in NORM_CHOICES:
        raise ValueError(f"norm must be one of {NORM_CHOICES}, got {norm!r}")
    if norm == "rmsnorm" and keep_hidden_states:
        raise ValueError(KEEP_VS_CENTER)
    inputs = trace_inputs(input_ids, example_inputs)
    result = traced if traced is not None else walk(model, inputs, keep_hidden_states=keep_hidden_states)
    if not result.sites:
        raise NormswapError(f"{_model_name(model)}: {no_norms_message(result)}")
    centering = None
    if norm == "rmsnorm":
        from normswap.center import center

        centering = center(model, result, inputs, untie=untie, add_biases=fold)
    report = ConvertReport(
        model=_model_name(model), norm=norm, norms_found=len(result.sites), norms_folded=0, norms_swapped=0,
        sites=result.sites, untouched=result.untouched, keep_hidden_states=keep_hidden_states,
    )  # fmt: skip
    if fold:
        folding = plan(model, result, untie=untie)
        if folding.untie_bytes:
            log.info("untying %s costs %d extra bytes", ", ".join(f"{m}.{a}" for m, a in folding.untie),
                     folding.untie_bytes)  # fmt: skip
        report.untied = untie_checked(model, folding, inputs).names
        report.untie_bytes = folding.untie_bytes
        # every scale is read before any norm is reset: norms sharing one Parameter fold with its value
        scales = {s.name: scale_and_shift(s, model.get_submodule(s.name)) for s in folding.sites}
        for site in folding.sites:
            fold_site(model, site, scales[site.name])
        report.norms_folded = len(folding.sites)
    else:
        for site in result.sites:
            if site.foldable:
                site.reason = "folding disabled by option"
    if centering is not None:  # centering may untie an embedding written into the residual stream
        report.untied = centering.untied + report.untied
        report.untie_bytes += centering.untie_bytes
        if centering.note is None:
            report.centering = centering.to_dict()
    if swap:
        report.norms_swapped = swap_norms(model, result.sites)
    return report
