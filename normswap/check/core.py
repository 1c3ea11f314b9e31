"""reference_outputs / compare / check: is the converted model the same model?"""

from __future__ import annotations

import contextlib
import copy
import resource
import time
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from normswap.device import exact_float32, model_device
from normswap.errors import NormswapError

from . import contract, routing
from .localize import Capture, Probe, localize, plan_probes, rel_errors
from .metrics import (
    LogitSummary,
    hidden_metrics,
    logit_metrics,
    next_token_targets,
    perplexity,
    summarize_logits,
)
from .policy import (
    EXPLICIT_KEYS,
    FIXED,
    FLOAT32,
    FLOAT64,
    FLOAT64_RULE,
    HALF,
    against_reference,
    default_tolerance,
    dtype_name,
    float64_summary,
    judge,
    top1_within_margin,
    verdict_line,
)

MAX_LOGITS_BYTES = 2**30  # keep reference logits up to this size; summarize beyond


@dataclass
class Reference:
    """What :func:`compare` needs from the original model, so that the original can be converted in place.

    Attributes:
        input_ids: ``(B, T)`` long, CPU; or, for a model that reads no token ids (a waveform, an image), the
            ``normswap.walk.ExampleInputs`` it was run on.
        output: ``"logits"`` (causal LM) or ``"last_hidden_state"`` (encoder without a head).
        dtype: the original model's dtype name (chooses the tolerance policy).
        outputs: ``(B*T, V)`` logits (or ``(B*T, D)`` hidden states) in the model's output dtype, on the CPU;
            ``None`` when they were larger than ``max_logits_bytes`` and only ``summary`` is kept.
        summary: :class:`LogitSummary` of the logits when ``outputs`` is ``None``.
        upcast: for half-precision models, the float32-upcast original's outputs (or their summary).
        original_error: for half-precision models, the original's own metrics against ``upcast``.
        probes, captures: the localization plan and the original's sampled records (see ``localize``);
            for half precision the records of the float32-upcast run (a dict, or the mapping that
            ``reference_outputs``'s ``records`` made).
        captures_error: half precision: the original's own relative error per record against ``captures``.
        returned: every other output the forward returns (``output_hidden_states``, the base model's
            ``last_hidden_state``, encoder outputs), sampled (``contract.record``); float32-upcast for half
            precision, with ``returned_error`` the original's own relative error per output.
        sites: the ``NormSite`` records or names given.
        greedy: ``(B, N)`` long, the original's greedy continuation, or ``None``.
        peak_rss_mib: process peak resident memory when the reference was done.
        rerun: float32 only: returns the original model again (a fresh reload, a rebuild over its shards,
            a kept copy: :func:`reload_original`), which :func:`compare` may change and drops; ``None``
            when it cannot be re-obtained. Called only when the fixed bound misses (``policy``).
        routing: half precision, for a model that calls ``torch.topk`` (a mixture of experts' router): the
            float32 original's choices and the original's own run under them (``routing.Routing``), imposed
            on the converted model by :func:`compare`; ``None`` otherwise.
    """

    input_ids: torch.Tensor
    output: str
    dtype: str
    outputs: torch.Tensor | None
    summary: LogitSummary | None = None
    upcast: torch.Tensor | LogitSummary | None = None
    original_error: dict | None = None
    probes: list[Probe] = field(default_factory=list)
    captures: Mapping[str, torch.Tensor] = field(default_factory=dict)
    captures_error: dict[str, float] | None = None
    returned: Mapping[str, torch.Tensor] = field(default_factory=dict)
    returned_error: dict[str, float] | None = None
    sites: list = field(default_factory=list)
    greedy: torch.Tensor | None = None
    peak_rss_mib: float = 0.0
    rerun: Callable[[], torch.nn.Module] | None = None
    routing: routing.Routing | None = None

    @property
    def nbytes(self) -> int:
        """Bytes held in memory by the tensors of this record (captures kept elsewhere not counted)."""
        kept = [m.values() for m in (self.captures, self.returned) if isinstance(m, dict)]
        total = sum(t.numel() * t.element_size() for values in kept for t in values)
        for part in (self.outputs, self.summary, self.upcast):
            if isinstance(part, torch.Tensor):
                total += part.numel() * part.element_size()
            elif isinstance(part, LogitSummary):
                total += part.nbytes
        return total


@dataclass
class CheckResult:
    """Converted vs original: metrics, the tolerance applied, the verdict, where it broke.

    Differences are over the compared output (``output``: logits, or the last hidden state for encoders);
    KL is KL(original || converted) per token in nats; agreements are fractions in [0, 1];
    ``top1_agreement_margin`` counts top-1 flips at near-ties (original's top-2 margin below twice the
    max-abs tolerance) as agreement, ``top1_flip_max_margin`` is the largest margin at which the top-1
    flipped. Fields that do not apply (KL for an encoder, half-precision details in float32) are ``None``.
    ``contract`` states, per returned output (the main one first, then every hidden state, the base model's
    last hidden state, encoder outputs), "same", "changed by design" with the reason, or "changed"
    (``contract.OutputContract.to_dict()``); ``transform`` is the stream transform allowed by design.
    ``rule`` names the rule that decided (``policy``): ``"fixed bound"`` (float32/float64: max abs and
    top-1 against the original), ``"float64 reference"`` (float32, when the fixed bound missed) or
    ``"float32 reference"`` (half precision). ``float64_reference``: where the float64 rule ran,
    ``e_orig``, ``e_conv`` (max abs difference of each model's logits from the float64-upcast original's),
    ``kl_orig``, ``kl_conv`` (mean KL(float64 || model), nats), ``bound``, ``kl_bound``, the rule's
    constants, ``fixed_bound_missed`` (the fixed bound's failed criteria), ``seconds`` (the rerun's time),
    ``rerun_max_abs`` (the re-obtained original in float32 against the reference: 0 for the same model);
    ``{"unavailable": reason, "fixed_bound_missed": [...]}`` where the original could not be re-obtained
    or run in float64 (the fixed bound is then final); ``None`` where it did not run. ``localized``: in
    float32/float64 with sites that describe the conversion (folded or swapped: ``convert``'s, a saved
    output's), the point where the localization found a divergence that failed a check whose logits passed
    their rule (an error the size of float32 rounding in the logits); ``None`` otherwise (a given
    ``max_abs``/``top1`` tolerance leaves the logits' rule final). ``warnings``: lines about the checked
    folder that do not change the verdict by themselves (``contract.StreamTransform.warnings``: a file its
    manifest names is missing, e.g. a rotation's ``Q``, without which the stream is not compared).
    ``routing``: half precision, for a model that routes with ``torch.topk``: the float32 original's choices
    were imposed on both runs, and this is ``normswap.check.routing.judge``'s entry (rows each model alone
    would have routed otherwise, the largest score gap among them, the scores' worst error); else ``None``.
    """

    max_abs_logit_diff: float
    mean_abs_logit_diff: float
    max_rel_diff: float
    kl_mean: float | None
    kl_max: float | None
    top1_agreement: float | None
    top1_agreement_margin: float | None
    top1_flip_max_margin: float | None
    top5_agreement: float | None
    ppl_original: float | None
    ppl_converted: float | None
    tokens: int
    dtype: str
    tolerance: dict
    passed: bool
    failures: list[str] = field(default_factory=list)
    output: str = "logits"
    exact: bool = True
    half_precision: dict | None = None
    greedy_agreement: float | None = None
    greedy_tokens: int = 0
    divergence: dict | None = None
    peak_rss_mib: float = 0.0
    reference_mib: float = 0.0
    contract: list[dict] = field(default_factory=list)
    transform: dict | None = None
    rule: str = FIXED
    float64_reference: dict | None = None
    localized: str | None = None
    warnings: list[str] = field(default_factory=list)
    routing: dict | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> str:
        """A few human-readable lines."""
        verdict = "PASS" if self.passed else "FAIL"
        lines = [f"check {verdict} ({self.dtype}, {self.tokens} tokens, {self.output})"]
        lines.append(f"  {verdict_line(self.to_dict())}")
        lines.append(f"  max abs diff {self.max_abs_logit_diff:.3g}  mean abs {self.mean_abs_logit_diff:.3g}")
        if self.kl_mean is not None:
            near = (
                ""
                if self.top1_agreement_margin is None
                else f" (near-ties allowed {self.top1_agreement_margin:.2%})"
            )
            lines.append(
                f"  KL mean {self.kl_mean:.3g} max {self.kl_max:.3g}  top-1 {self.top1_agreement:.2%}{near}"
                f"  top-5 {self.top5_agreement:.2%}"
            )
        if self.ppl_original is not None:
            lines.append(f"  perplexity {self.ppl_original:.4f} -> {self.ppl_converted:.4f}")
        if self.greedy_tokens:
            lines.append(f"  greedy agreement {self.greedy_agreement:.2%} of {self.greedy_tokens} tokens")
        lines += [f"  {line}" for line in contract.lines(self.contract, self.to_dict())]
        if self.routing:
            lines.append(f"  routing: {routing.line(self.routing, self.dtype)}")
        lines += [f"  warning: {w}" for w in self.warnings]
        lines += [f"  failed: {f}" for f in self.failures]
        if self.divergence:
            lines.append(f"  first divergence: {self.divergence['description']}")
        return "\n".join(lines)


def peak_rss_mib() -> float:
    """Peak resident set size of this process so far, in MiB (``getrusage`` high-water mark)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _device(model: torch.nn.Module) -> torch.device:
    return model_device(model)


def _model_dtype(model: torch.nn.Module) -> torch.dtype:
    return getattr(model, "dtype", None) or next(model.parameters()).dtype


def _is_ids(inputs) -> bool:
    return isinstance(inputs, torch.Tensor)


def _targets(inputs) -> torch.Tensor | None:
    """Next-token targets of token ids; None for other inputs (compared on hidden states only)."""
    return next_token_targets(inputs) if _is_ids(inputs) else None


def _forward(model: torch.nn.Module, input_ids) -> tuple[str, torch.Tensor]:
    """One forward; returns (output kind, ``(B*T, V or D)`` output on the CPU) (see ``_forward_all``)."""
    kind, value, _ = _forward_all(model, input_ids)
    return kind, value


@torch.no_grad()
def _forward_all(
    model: torch.nn.Module,
    input_ids,
    returned: MutableMapping[str, torch.Tensor] | None = None,
    norms=(),
) -> tuple[str, torch.Tensor, dict[str, str]]:
    """One forward; returns (output kind, ``(B*T, V or D)`` output on the CPU, producers).

    The inputs are the walk's (``normswap.walk.example_inputs``): ``input_ids``, ``use_cache=False`` where
    the forward takes it, and for an encoder-decoder the same ids as ``decoder_input_ids``; or
    ``ExampleInputs`` as given (a waveform, an image: the rows are then every position of the output). With
    ``returned`` (a mapping), the forward also returns its hidden states (``output_hidden_states=True`` where
    it takes it) and every other output is sampled into ``returned`` (``contract.record``); ``producers``
    then maps each output that is the output of one of the modules named in ``norms`` to its name.
    """
    from normswap.walk import accepts, example_inputs

    example = example_inputs(model, input_ids)  # the ids on the model's input device
    args, kwargs = example.args, dict(example.kwargs)
    if not _is_ids(input_ids):  # explicit inputs (a waveform, an image), moved to the model's input device
        from torch.utils._pytree import tree_map

        device = _device(model)
        args, kwargs = tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, (args, kwargs))
    if returned is not None and accepts(model, "output_hidden_states"):
        kwargs["output_hidden_states"] = True
    with contract.Watch(model, norms if returned is not None else ()) as watch:
        out = model(*args, **kwargs)
    logits = getattr(out, "logits", None)
    kind, value = ("logits", logits) if logits is not None else ("last_hidden_state", None)
    if value is None:
        value = getattr(out, "last_hidden_state", None)
        if value is None:  # a plain tensor is the output itself (indexing it would take batch row 0)
            value = out if isinstance(out, torch.Tensor) else out[0]
    producers: dict[str, str] = {}
    if returned is not None:
        outputs = contract.returned_outputs(out, watch.extra)
        main = next((i for i, (_, t) in enumerate(outputs) if t is value), None)  # judged by the metrics
        outputs = [o for i, o in enumerate(outputs) if i != main]
        contract.record(outputs, returned, input_ids)
        producers = {n: name for n, t in outputs if (name := watch.producer(t)) is not None}
    return kind, value.reshape(-1, value.shape[-1]).cpu(), producers


@contextlib.contextmanager
def upcast(model: torch.nn.Module, dtype: torch.dtype = torch.float32, *, restore: bool = True):
    """Hold every floating parameter and buffer of a narrower dtype in ``dtype`` (float32 or float64)
    inside the block; restores each one's own dtype after (``restore=False``: the model stays in ``dtype``).

    Exact (``dtype`` holds every value of the narrower dtypes: bfloat16/float16 -> float32, float32 ->
    float64), so the restored model is bit-identical. Needs the model's ``dtype`` size in memory beside
    the original values (``restore=False``: each tensor's old values are freed as it is converted, so the
    peak is the ``dtype`` size). Tensors whose bytes stay on disk (``normswap.stream``'s released
    placeholders) stay there, read in ``dtype`` when their module runs.
    """
    saved = []
    for t in list(model.parameters()) + list(model.buffers()):
        if t.is_floating_point() and t.dtype != dtype and t.dtype.itemsize <= dtype.itemsize:
            if restore:
                saved.append((t, t.data))
            if t.numel() and t.untyped_storage().nbytes() == 0:  # bytes on disk (normswap.stream): stay there
                empty = torch.empty(t.shape, dtype=dtype, device=t.device)
                empty.untyped_storage().resize_(0)
                t.data = empty
            else:
                t.data = t.data.to(dtype)
    try:
        yield model
    finally:
        for t, data in saved:
            t.data = data


def _imposed(model: torch.nn.Module, choices):
    """``routing.Choices(model, replay=choices)`` around a forward when there are choices to impose; else
    nothing: the forward runs as is (the context gives ``None``)."""
    return routing.Choices(model, replay=choices) if choices else contextlib.nullcontext()


def _refuse_nonfinite(outputs: torch.Tensor, input_ids: torch.Tensor, kind: str, what: str) -> None:
    """Raise when the original model's ``(B*T, V)`` outputs hold a NaN or inf: nothing can be checked."""
    bad = ~torch.isfinite(outputs)
    if not bad.any():
        return
    rows = bad.any(-1).nonzero().flatten()
    if _is_ids(input_ids):
        batch, pos = divmod(int(rows[0]), input_ids.shape[1])
        where = f"batch {batch} position {pos}"
    else:
        where = f"output row {int(rows[0])}"
    raise NormswapError(
        f"the original model's {kind}{what} are not finite ({int(bad.sum())} NaN or infinite values, "
        f"first at {where}): the input model is broken, there is nothing to check"
    )


def _refuse_overflow(model, input_ids: torch.Tensor, outputs: torch.Tensor, kind: str, dtype: str) -> None:
    """Raise when the original's half-precision ``outputs`` are not finite while its float32 run (the same
    weights upcast, :func:`upcast`) is: the model is fine, ``dtype``'s range is not (float16 ends at 65504;
    Gemma's activations pass it). Returns when the float32 run is not finite either (the model is broken)."""
    with upcast(model):
        _, up = _forward(model, input_ids)
    if not bool(torch.isfinite(up).all()):
        return
    bad = ~torch.isfinite(outputs)
    batch, pos = divmod(int(bad.any(-1).nonzero().flatten()[0]), input_ids.shape[1])
    instead = "bfloat16 (float32's range at half the memory) or float32" if dtype == "float16" else "float32"
    raise NormswapError(
        f"the original model's {kind} in {dtype} are not finite ({int(bad.sum())} NaN or infinite values, "
        f"first at batch {batch} position {pos}) while in float32 they are: the model overflows {dtype}'s "
        f"range (largest value {torch.finfo(getattr(torch, dtype)).max:g}), it is not broken; use --dtype "
        f"{instead}"
    )


def _keep(outputs: torch.Tensor, targets: torch.Tensor, kind: str, max_bytes: int):
    if kind == "logits" and outputs.numel() * outputs.element_size() > max_bytes:
        return None, summarize_logits(outputs, targets)
    return outputs, None


def _metrics(kind: str, ref, conv: torch.Tensor, targets: torch.Tensor) -> dict:
    return logit_metrics(ref, conv, targets) if kind == "logits" else hidden_metrics(ref, conv)


@torch.no_grad()
def _greedy(model, input_ids: torch.Tensor, n: int) -> torch.Tensor:
    ids = input_ids.to(_device(model))
    pad = getattr(model.generation_config, "pad_token_id", None)
    eos = getattr(model.generation_config, "eos_token_id", None)
    if pad is None:
        pad = eos[0] if isinstance(eos, list) else (eos if eos is not None else 0)
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), do_sample=False, num_beams=1, max_new_tokens=n,
        min_new_tokens=n, pad_token_id=pad, top_k=None, top_p=None, temperature=None,
    )  # fmt: skip
    return out[:, ids.shape[1] :].cpu()


@exact_float32()
def reference_outputs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    *,
    sites=None,
    greedy_tokens: int = 0,
    max_logits_bytes: int = MAX_LOGITS_BYTES,
    records: Callable[[], MutableMapping[str, torch.Tensor]] | None = None,
    rerun: Callable[[], torch.nn.Module] | None = None,
) -> Reference:
    """Run the original model once and keep only what :func:`compare` needs (call BEFORE converting in place).

    Kept: the outputs (logits ``(B*T, V)`` in the model's dtype, or a :class:`LogitSummary` when they exceed
    ``max_logits_bytes``: top-64 logits, log-sum-exp, tail mass and next-token log-probs per token); for
    bfloat16/float16 models also the float32-upcast model's outputs (see :func:`upcast`) and the original's
    own error against them; every other output the forward returns with ``output_hidden_states=True`` (the
    hidden states, the base model's last hidden state, encoder outputs), sampled at the localization's
    positions, for the contract (``normswap.check.contract``); sampled per-site records for localization
    when ``sites`` is given; the greedy continuation when ``greedy_tokens > 0``.

    Args:
        model: the original model (``AutoModelForCausalLM`` with ``.logits`` or an encoder with
            ``.last_hidden_state``), in eval mode.
        input_ids: ``(B, T)`` long token ids (``default_input_ids`` gives real text), or
            ``normswap.walk.ExampleInputs`` for a model that reads no ids (``normswap.walk.signal_inputs``
            makes a waveform or an image); compared on its last hidden state, no greedy continuation.
        sites: ``NormSite`` records (from ``normswap.inspect``/the walk) or norm module names, to localize a
            divergence; ``None`` skips localization.
        greedy_tokens: new tokens to generate greedily for the generation-agreement metric.
        max_logits_bytes: above this many bytes the logits are summarized instead of kept.
        records: makes the mapping each localization capture records into (default: a dict in memory;
            ``normswap.stream.records.DiskRecords`` keeps them in a temporary file).
        rerun: float32: returns the original model again, for :func:`compare`'s float64 rule when the
            fixed bound misses (:func:`reload_original`, or ``lambda: copy.deepcopy(original)``); ``None``:
            the fixed bound is final (see ``Reference.rerun``).

    Raises:
        ValueError: if ``input_ids`` is not a 2-D integer tensor with at least 2 positions.
        NormswapError: the original's outputs hold a NaN or inf (a broken input model: no conversion of
            it can be checked; or, in half precision with finite float32 outputs, a model that overflows the
            dtype's range: the line then names the dtype to use instead); the line names the count and the
            first position.
    """
    if _is_ids(input_ids):
        if input_ids.ndim != 2 or input_ids.is_floating_point() or input_ids.shape[1] < 2:
            raise ValueError(f"input_ids must be a (B, T>=2) integer tensor, got {tuple(input_ids.shape)}")
        input_ids = input_ids.cpu()
    targets = _targets(input_ids)
    dtype = dtype_name(_model_dtype(model))
    probes = plan_probes(model, sites) if sites else []
    returned = records() if records else {}
    choices = None
    if dtype in HALF:  # float32 first: its routing choices are imposed on the run in the model's own dtype
        returned32 = records() if records else {}
        with upcast(model), Capture(model, probes, input_ids, records and records()) as cap32:
            with routing.Choices(model) as recorded:
                _, up, _ = _forward_all(model, input_ids, returned32)
        choices = recorded.choices or None
    with Capture(model, probes, input_ids, records and records()) as cap, _imposed(model, choices) as own:
        kind, outputs, _ = _forward_all(model, input_ids, returned)
    if dtype in HALF and not bool(torch.isfinite(outputs).all()):
        _refuse_overflow(model, input_ids, outputs, kind, dtype)
    _refuse_nonfinite(outputs, input_ids, kind, "")
    ref = Reference(input_ids, kind, dtype, *_keep(outputs, targets, kind, max_logits_bytes))
    ref.probes, ref.captures, ref.sites, ref.returned = probes, cap.records, list(sites or []), returned
    ref.rerun = rerun
    if choices:
        ref.routing = routing.Routing(choices, own.run)
    if dtype in HALF:
        _refuse_nonfinite(up, input_ids, kind, " in float32")
        ref.captures_error = rel_errors(cap32.records, ref.captures)
        ref.captures = cap32.records
        ref.returned_error = rel_errors(returned32, returned)
        ref.returned = returned32
        ref.original_error = _metrics(kind, up, outputs, targets)
        del outputs
        full, summary = _keep(up, targets, kind, max_logits_bytes)
        ref.upcast = full if full is not None else summary
    if greedy_tokens and kind == "logits" and _is_ids(input_ids):
        ref.greedy = _greedy(model, input_ids, greedy_tokens)
    ref.peak_rss_mib = peak_rss_mib()
    return ref


class NoFloat64Reference(Exception):
    """The float64 rule cannot run: the original cannot be re-obtained (``Reference.rerun`` is ``None``:
    converted in place with no source to reload), its reload failed, it is not the same model, or it does
    not run in float64 (a device without float64). The fixed bound is then final; the message says why."""


def reload_original(load: Callable[[], torch.nn.Module]) -> Callable[[], torch.nn.Module]:
    """``Reference.rerun`` from a function that loads the original again (from its source: a hub id, a
    directory, a GGUF file; or rebuilt over untouched shards): any error it raises (a source gone, a hub
    offline) becomes :class:`NoFloat64Reference` with its first line."""

    def rerun() -> torch.nn.Module:
        try:
            return load()
        except Exception as error:  # noqa: BLE001 - any loader's error: the fixed bound stays final
            line = str(error).splitlines()[0] if str(error) else type(error).__name__
            raise NoFloat64Reference(f"reloading the original failed ({line})") from error

    return rerun


def keep_original(original: torch.nn.Module) -> Callable[[], torch.nn.Module]:
    """``Reference.rerun`` for an original that stays in memory, unconverted (:func:`check`): a deep copy
    of it (the rule changes the copy's dtype and drops it; ``original`` is not touched)."""
    return lambda: copy.deepcopy(original)


@exact_float32()
@torch.no_grad()
def float64_metrics(reference: Reference, conv: torch.Tensor) -> tuple[dict, dict, dict]:
    """The original and the converted model against the float64-upcast original, on the reference's input.

    Calls ``reference.rerun()``, runs that model once in its own dtype (it must reproduce the reference's
    outputs within the dtype's fixed bound: the same model) and once with every floating parameter and
    buffer upcast to float64 (:func:`upcast`, in place: the rerun's model is dropped after).

    Args:
        reference: from :func:`reference_outputs` with ``rerun``.
        conv: the converted model's ``(N, V)`` logits (or ``(N, D)`` hidden states) on the reference's input.

    Returns:
        ``(original's metrics, converted metrics, extra)`` against the float64 outputs
        (``logit_metrics``/``hidden_metrics``); ``extra``: ``seconds`` of the rerun, ``rerun_max_abs``.
        Peak memory: the rerun's model in float64 (twice its float32 size) and one float64 forward's
        activations and outputs, beside the converted model and what the check holds.

    Raises:
        NoFloat64Reference: no ``rerun``, its model is not the same as the reference's, or it fails.
    """
    if reference.rerun is None:
        raise NoFloat64Reference("the original cannot be re-obtained (converted in place, no source given)")
    start = time.perf_counter()
    model = reference.rerun()
    try:
        ids, targets, kind = reference.input_ids, _targets(reference.input_ids), reference.output
        own_dtype = dtype_name(_model_dtype(model))
        if own_dtype != reference.dtype:
            raise NoFloat64Reference(
                f"the re-obtained original is {own_dtype}, the checked one {reference.dtype}"
            )
        _, own = _forward(model, ids)
        ref_out = reference.outputs if reference.outputs is not None else reference.summary
        same = _metrics(kind, ref_out, own, targets)["max_abs"]
        if not same <= default_tolerance(reference.dtype)["max_abs"]:
            raise NoFloat64Reference(
                f"the re-obtained original is not the same model (its outputs differ from the reference's "
                f"by {same:.3g})"
            )
        with upcast(model, torch.float64, restore=False):
            _, out64 = _forward(model, ids)
    except NoFloat64Reference:
        raise
    except Exception as error:  # noqa: BLE001 - float64 not supported here, out of memory: fixed bound final
        line = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise NoFloat64Reference(f"the original does not run in float64 here ({line})") from error
    finally:
        del model
    if not bool(torch.isfinite(out64).all()):
        raise NoFloat64Reference("the float64 original's outputs are not finite")
    orig = _metrics(kind, out64, own, targets)
    del own
    converted = _metrics(kind, out64, conv, targets)
    return orig, converted, {"seconds": time.perf_counter() - start, "rerun_max_abs": same}


@exact_float32()
def compare(
    reference: Reference,
    converted_model: torch.nn.Module,
    input_ids: torch.Tensor | None = None,
    tolerance: dict | None = None,
    *,
    sites=None,
    records: Callable[[], MutableMapping[str, torch.Tensor]] | None = None,
    transform: contract.StreamTransform | None = None,
    keep_hidden_states: bool = False,
) -> CheckResult:
    """Run the converted model on the reference's input and judge it (see ``policy`` for the rules).

    Args:
        reference: from :func:`reference_outputs` on the original model.
        converted_model: the converted model (may be the original object, converted in place).
        input_ids: optional; must equal ``reference.input_ids`` if given.
        tolerance: overrides for :func:`~normswap.check.policy.default_tolerance` of the reference's
            dtype (keys ``max_abs``, ``top1`` for float32/64; ``k``, ``abs``, ``kl_abs`` for half;
            ``localize_rtol``). A ``max_abs`` or ``top1`` given here makes float32's fixed bound final;
            otherwise, where it misses, ``reference.rerun`` gives the original again and both models are
            judged against it in float64 (:func:`float64_metrics`, ``policy.FLOAT64_RULE``; ``rule`` and
            ``float64_reference`` of the result say which rule decided and its numbers).
        sites: ``NormSite`` records after conversion (their ``folded``/``swapped``/``reason`` describe a
            divergence); defaults to the sites given to ``reference_outputs``.
        records: makes the mapping the converted model's localization records go into (as in
            :func:`reference_outputs`).
        transform: the change the conversion made to the residual stream by design
            (``contract.centered()`` after ``norm="rmsnorm"``): an output or localization record that
            equals the transformed original is "changed by design" / matches.
        keep_hidden_states: every returned output must stay the same (``convert(keep_hidden_states=True)``).

    Returns:
        :class:`CheckResult`; ``divergence`` names the first diverging site when probes were recorded;
        ``contract`` judges every output the forward returns (``normswap.check.contract``), and an output
        that changed with no conversion step to explain it fails the check.

    Raises:
        ValueError: if ``input_ids`` differs from the reference's, or the converted model's output kind or
            shape differs from the original's.
    """
    if input_ids is not None and (
        _is_ids(input_ids) != _is_ids(reference.input_ids)
        or (_is_ids(input_ids) and not torch.equal(input_ids.cpu(), reference.input_ids))
    ):
        raise ValueError("input_ids differ from the ones the reference was computed on")
    ids = reference.input_ids
    targets = _targets(ids)
    tol = default_tolerance(reference.dtype) | dict(tolerance or {})
    sites = sites or reference.sites
    names = [s if isinstance(s, str) else s.name for s in sites or ()]
    returned = records() if records else {}
    choices = reference.routing.choices if reference.routing is not None else None
    with Capture(converted_model, reference.probes, ids, records and records()) as cap:
        with _imposed(converted_model, choices) as chosen:
            kind, conv, producers = _forward_all(converted_model, ids, returned, names)
    ref_out = reference.outputs if reference.outputs is not None else reference.summary
    rows = ids.numel() if _is_ids(ids) else ref_out.shape[0]
    if kind != reference.output or conv.shape[0] != rows:
        raise ValueError(
            f"converted model returns {kind} {tuple(conv.shape)}, the original {reference.output}"
        )
    m = _metrics(kind, ref_out, conv, targets)
    half = None
    if reference.dtype in HALF:
        half = {
            "original": reference.original_error,
            "converted": _metrics(kind, reference.upcast, conv, targets),
        }
    failures = judge(m, tol, half)
    logits_passed = not failures  # by the fixed bound, or (below) by the float64 reference
    rule, f64 = (FLOAT32 if half is not None else FIXED), None
    explicit = any(key in (tolerance or {}) for key in EXPLICIT_KEYS)
    nonfinite = m.get("nonfinite_ref") or m.get("nonfinite_conv")
    if failures and reference.dtype == "float32" and not explicit and not nonfinite:
        try:
            orig64, conv64, extra = float64_metrics(reference, conv)
        except NoFloat64Reference as why:
            f64 = {"unavailable": str(why), "fixed_bound_missed": list(failures)}
        else:
            rule = FLOAT64
            f64 = float64_summary(orig64, conv64) | extra | {"fixed_bound_missed": list(failures)}
            missed = against_reference(orig64, conv64, FLOAT64_RULE, "float64")
            failures = failures + missed if missed else []
            logits_passed = not missed
    verdict = contract.CHANGED if failures else contract.SAME
    main = contract.OutputContract(kind, verdict, m["max_abs"], None, None)
    entries, broken = contract.judge(
        reference.returned, returned, rtol=tol["localize_rtol"], own=reference.returned_error,
        k=tol.get("k", 0.0), transform=transform, producers=producers,
        sites=[s for s in sites or () if not isinstance(s, str)], keep_hidden_states=keep_hidden_states,
    )  # fmt: skip
    failures += broken
    routed = None
    if reference.routing is not None:
        routed, missed = routing.judge(reference.routing, chosen.run, tol["localize_rtol"], tol.get("k", 0.0))
        failures += missed
    divergence = None
    if reference.probes:
        divergence = localize(
            reference.probes,
            reference.captures,
            cap.records,
            tol["localize_rtol"],
            sites,
            own=reference.captures_error,
            k=tol.get("k", 0.0),
            transform=transform,
        )
    localized = None
    # neither logits rule can tell an error of the size of float32 rounding from rounding; the localization's
    # records (1e-5 relative at each point) can, and name where it starts. As for the contract, without
    # sites that describe the conversion a divergence is reported only.
    gate = half is None and not explicit and logits_passed and contract.describes_conversion(sites)
    if divergence is not None and gate:
        localized = divergence["point"]
        held = "the float64 reference passes" if rule == FLOAT64 else "the logits are within the fixed bound"
        failures.append(
            f"{held}, but {localized} differs beyond rounding (relative error "
            f"{divergence['rel_error']:.3g} > {divergence['threshold']:.3g}): a change the logits cannot "
            "tell from float32 rounding"
        )
    greedy = None
    if reference.greedy is not None:
        new = _greedy(converted_model, ids, reference.greedy.shape[1])
        same = (new == reference.greedy).all(0).int().tolist() + [0]
        greedy = same.index(0) / reference.greedy.shape[1]  # common prefix: later tokens see other contexts
    is_logits = kind == "logits"
    return CheckResult(
        max_abs_logit_diff=m["max_abs"],
        mean_abs_logit_diff=m["mean_abs"],
        max_rel_diff=m["max_rel"],
        kl_mean=m.get("kl_mean"),
        kl_max=m.get("kl_max"),
        top1_agreement=m.get("top1"),
        top1_agreement_margin=top1_within_margin(m, tol) if is_logits and half is None else None,
        top1_flip_max_margin=max(m["flip_margins"], default=None) if is_logits else None,
        top5_agreement=m.get("top5"),
        ppl_original=perplexity(m["nll_ref"], m["n_targets"]) if is_logits else None,
        ppl_converted=perplexity(m["nll_conv"], m["n_targets"]) if is_logits else None,
        tokens=rows,
        dtype=reference.dtype,
        tolerance=tol,
        passed=not failures,
        failures=failures,
        output=kind,
        exact=m["exact"],
        half_precision=half,
        greedy_agreement=greedy,
        greedy_tokens=0 if reference.greedy is None else reference.greedy.shape[1],
        divergence=divergence,
        peak_rss_mib=peak_rss_mib(),
        reference_mib=reference.nbytes / 2**20,
        contract=[e.to_dict() for e in [main, *entries]],
        transform=transform.to_dict() if transform is not None else None,
        rule=rule,
        float64_reference=f64,
        localized=localized,
        warnings=list(transform.warnings) if transform is not None else [],
        routing=routed,
    )


def check(
    original: torch.nn.Module,
    converted: torch.nn.Module,
    input_ids: torch.Tensor,
    tolerance: dict | None = None,
    *,
    sites=None,
    greedy_tokens: int = 0,
) -> CheckResult:
    """Compare two models held in memory: ``compare(reference_outputs(original, ...), converted, ...)``.

    Both models are in memory (about 2x one model); to convert in place and keep about 1x, call
    :func:`reference_outputs` before converting and :func:`compare` after (lean mode).
    Arguments as in :func:`reference_outputs` and :func:`compare`; a float32 check whose fixed bound
    misses runs a copy of ``original`` in float64 (:func:`keep_original`).
    """
    ref = reference_outputs(
        original, input_ids, sites=sites, greedy_tokens=greedy_tokens, rerun=keep_original(original)
    )
    return compare(ref, converted, input_ids, tolerance, sites=sites)


@exact_float32()
@torch.no_grad()
def compare_inputs_embeds(
    reference: Reference, converted_model: torch.nn.Module, inputs_embeds: torch.Tensor, tolerance=None
) -> dict[str, Any]:
    """Run the converted model on ``inputs_embeds`` (instead of the reference's ids) and judge its outputs
    against the reference's, with the check's tolerance policy.

    Proves an ``inputs_embeds`` transform (``normswap.center.inputs``): give the transformed embeddings of
    the reference's ids in the original model.

    Args:
        reference: from :func:`reference_outputs`.
        converted_model: the converted model (a forward that takes ``inputs_embeds``).
        inputs_embeds: ``(B, T, D)`` for the reference's ``(B, T)`` ids.
        tolerance: overrides of the dtype's default tolerance, as in :func:`compare`.

    Returns:
        ``{"max_abs_diff", "passed", "failures"}``.
    """
    from normswap.walk import accepts

    ids = reference.input_ids
    targets = next_token_targets(ids)
    tol = default_tolerance(reference.dtype) | dict(tolerance or {})
    kwargs = {"inputs_embeds": inputs_embeds.to(model_device(converted_model))}
    if accepts(converted_model, "use_cache"):
        kwargs["use_cache"] = False
    out = converted_model(**kwargs)
    value = getattr(out, "logits", None)
    if value is None:
        value = getattr(out, "last_hidden_state", None)
    conv = value.reshape(-1, value.shape[-1]).cpu()
    ref_out = reference.outputs if reference.outputs is not None else reference.summary
    m = _metrics(reference.output, ref_out, conv, targets)
    half = None
    if reference.dtype in HALF:
        half = {"original": reference.original_error,
                "converted": _metrics(reference.output, reference.upcast, conv, targets)}  # fmt: skip
    failures = judge(m, tol, half)
    return {"max_abs_diff": m["max_abs"], "passed": not failures, "failures": failures}
