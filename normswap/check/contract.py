"""The converted model's contract beyond its logits: every output its forward returns, judged one by one.

Users read more than logits: ``output_hidden_states`` (reward models, value heads, draft heads, logit lens),
the base model's ``last_hidden_state`` (embedding extraction), an encoder-decoder's encoder outputs. The
check runs both models with ``output_hidden_states=True`` (where the forward takes it) and a hook on the base
model, and states for each floating tensor returned (``returned_outputs``) one of:

* ``same``: within the check's threshold of the original's (relative Frobenius error, as localization);
* ``changed by design``: a conversion step explains it, and the reason names the step -- a norm whose output
  is returned had its weight folded into the layers that read it (the final norm into ``lm_head``); or the
  residual stream was transformed (``StreamTransform``: centered by ``--norm rmsnorm``), and the converted
  value equals the transformed original within the threshold;
* ``changed``: no step explains it; the check fails when it knows what the conversion did (``NormSite``
  records: ``convert``'s own check, ``normswap check`` with a manifest), and otherwise reports it.

Each output is compared at the check's sampled token positions (``localize.sample_positions``: at most 32,
first and last included), in float64: the reference keeps ``O(outputs x positions x width)`` (35 MB for a
32-layer model of width 4096), in the mapping ``records`` makes (a dict, or ``stream.records.DiskRecords``).
The converted model's outputs are compared one at a time as its forward returns them.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from .localize import _sample, sample_positions

SAME = "same"
BY_DESIGN = "changed by design"
CHANGED = "changed"
_SKIP = {"loss", "past_key_values", "cache", "cache_params", "rope_deltas"}


@dataclass
class StreamTransform:
    """A change the conversion makes to the residual stream by design, and how it maps the original's values
    onto the converted model's.

    Attributes:
        name: ``"centered"`` (``--norm rmsnorm``), or another transform's name (a rotation: ``"rotated"``).
        reason: the line a user reads, e.g. ``"the residual stream is centered (minus its mean over the
            hidden axis)"``.
        apply: maps a float64 tensor of the original (features on the last axis) to the converted model's.
        file: the file in the output directory that holds the transform (``centering.json``), or None.
        rewritten_inputs: norm sites whose *input* the conversion rewrites otherwise (BLOOM's embedding
            norm reads a rewritten table): localization does not compare those inputs.
        writers: modules whose output is written into the stream; a norm's consumer among them (a fused
            MoE experts module reads the norm and writes the stream) has its output compared through
            ``apply`` too.
        not_compared: modules whose output changes by design in a way ``apply`` does not map: centered per
            group (the heads a per-head LayerNorm reads, Cohere's and Persimmon's q/k norms: localization
            compares the per-head norms' inputs after them instead) or rotated per head (``--rotate-heads``:
            the value projections' outputs times ``H``; the layer's output is compared).
        unavailable: why ``apply`` cannot run (a rotation whose saved ``Q`` is missing or is not the one
            recorded), or None. Then nothing on the residual stream is compared (localization skips its
            records; a returned output that differs is "changed by design", not verified) and the main
            output (the logits) decides.
        warnings: lines for the user about the checked folder (a file the manifest names that is missing),
            carried into ``CheckResult.warnings``.
    """

    name: str
    reason: str
    apply: Callable[[torch.Tensor], torch.Tensor] | None = field(repr=False)
    file: str | None = None
    rewritten_inputs: frozenset[str] = frozenset()
    writers: frozenset[str] = frozenset()
    not_compared: frozenset[str] = frozenset()
    unavailable: str | None = None
    warnings: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "reason": self.reason, "file": self.file, "unavailable": self.unavailable}


def centered(file: str | None = None, rewritten_inputs=(), writers=(), not_compared=()) -> StreamTransform:
    """The centering of ``--norm rmsnorm``: every row minus its mean over the last (hidden) axis;
    ``writers`` and ``not_compared`` as in ``StreamTransform``."""
    return StreamTransform(
        "centered",
        "the residual stream is centered: the original minus its mean over the hidden axis",
        lambda t: t - t.mean(-1, keepdim=True),
        file,
        frozenset(rewritten_inputs),
        frozenset(writers),
        frozenset(not_compared),
    )


def rotated(
    q: torch.Tensor | None,
    centered: bool,
    file: str | None = None,
    rewritten_inputs=(),
    writers=(),
    not_compared=(),
    *,
    unavailable: str | None = None,
    warnings=(),
) -> StreamTransform:
    """The rotation of ``--rotate`` (``normswap.rotate``): ``h -> h Q`` for every row (after subtracting its
    mean over the hidden axis for a centered, LayerNorm, model); ``q`` is the ``(hidden, hidden)`` matrix,
    or None when it cannot be had (``unavailable`` says why: nothing on the stream is compared); the other
    arguments as in ``StreamTransform``."""
    centering = " minus its mean over the hidden axis," if centered else ""
    reason = f"the residual stream is rotated: the original{centering} times Q"
    if q is None:
        return StreamTransform("rotated", f"{reason}; not compared: {unavailable}", None, file,
                               frozenset(rewritten_inputs), frozenset(writers), frozenset(not_compared),
                               unavailable or "Q is not known", tuple(warnings))  # fmt: skip
    q = q.detach().to("cpu", torch.float64)

    def apply(t: torch.Tensor) -> torch.Tensor:
        t = t.double()
        if centered:  # also a per-head norm's input, centered per head (not rotated)
            t = t - t.mean(-1, keepdim=True)
        if t.shape[-1] != q.shape[0]:
            return t  # not the stream: not rotated
        return t @ q

    return StreamTransform(
        "rotated",
        reason,
        apply,
        file,
        frozenset(rewritten_inputs),
        frozenset(writers),
        frozenset(not_compared),
        warnings=tuple(warnings),
    )


@dataclass
class OutputContract:
    """One returned output, converted vs original, and what holds for it.

    Attributes:
        output: as a user names it: ``"logits"``, ``"hidden_states[3]"``, ``"model.last_hidden_state"``
            (the base model ``model.model``), ``"encoder_last_hidden_state"``.
        status: ``"same"``, ``"changed by design"`` or ``"changed"``.
        max_abs_diff: largest ``|converted - original|`` over the compared positions (for the main output,
            the logits or an encoder's last hidden state: over every position, as the check's metrics).
        rel_error: ``||converted - original|| / ||original||`` (Frobenius) there; None for the main output,
            which the check's tolerance policy judges.
        threshold: the relative error allowed for ``same`` (see ``localize``); None for the main output.
        reason: for ``changed by design``: the conversion step that changes it.
        relation: the transform whose image of the original the converted output equals (``"centered"``),
            with ``relation_error`` its relative error; None otherwise.
        file: where the transform is given (a file in the output directory), for a relation.
    """

    output: str
    status: str
    max_abs_diff: float
    rel_error: float | None
    threshold: float | None
    reason: str | None = None
    relation: str | None = None
    relation_error: float | None = None
    file: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def returned_outputs(out, extra: Mapping[str, torch.Tensor] | None = None) -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` for every floating tensor a forward returned: a ``ModelOutput``'s fields (tuples
    as ``name[i]``), a tuple's items (``output[i]``) or a single tensor (``output``), then ``extra`` (the
    base model's output, recorded by ``Watch``). Losses and caches are left out."""
    items: list[tuple[str, Any]]
    if isinstance(out, torch.Tensor):
        items = [("output", out)]
    elif hasattr(out, "items"):
        items = [(k, v) for k, v in out.items() if k not in _SKIP]
    elif isinstance(out, tuple | list):
        items = [(f"output[{i}]", v) for i, v in enumerate(out)]
    else:
        items = []
    found = []
    for name, value in [*items, *(extra or {}).items()]:
        if isinstance(value, torch.Tensor):
            found.append((name, value))
        elif isinstance(value, tuple | list):
            found += [(f"{name}[{i}]", v) for i, v in enumerate(value) if isinstance(v, torch.Tensor)]
    return [(n, t) for n, t in found if t.is_floating_point()]


class Watch:
    """Context manager around one forward: hooks the base model (``model.base_model`` when it is a
    submodule, its ``last_hidden_state`` recorded as ``"<name>.last_hidden_state"``) and, for the
    converted model, the norm modules ``norms`` (names), to tell which norm produced a returned tensor."""

    def __init__(self, model: torch.nn.Module, norms=()):
        self.model = model
        self.norms = list(norms)
        self.extra: dict[str, torch.Tensor] = {}
        self.made: list[tuple[str, weakref.ref]] = []
        self._handles: list = []

    def __enter__(self) -> Watch:
        modules = dict(self.model.named_modules())
        base = getattr(self.model, "base_model", None)
        if isinstance(base, torch.nn.Module) and base is not self.model:
            name = next((n for n, m in modules.items() if m is base), None)
            if name:
                self._handles.append(base.register_forward_hook(self._base_hook(name)))
        for norm in self.norms:
            if norm in modules:
                self._handles.append(modules[norm].register_forward_hook(self._norm_hook(norm)))
        return self

    def _base_hook(self, name: str):
        def hook(module, args, output):
            value = getattr(output, "last_hidden_state", None)
            if value is None and isinstance(output, tuple | list) and output:
                value = output[0]
            if isinstance(value, torch.Tensor):
                self.extra[f"{name}.last_hidden_state"] = value

        return hook

    def _norm_hook(self, name: str):
        def hook(module, args, output):
            if isinstance(output, torch.Tensor):
                self.made.append((name, weakref.ref(output)))

        return hook

    def producer(self, t: torch.Tensor) -> str | None:
        """The watched norm whose output ``t`` is (or shares storage with), or None."""
        ptr = t.untyped_storage().data_ptr()
        for name, ref in reversed(self.made):
            out = ref()
            if out is not None and (out is t or (out.numel() and out.untyped_storage().data_ptr() == ptr)):
                return name
        return None

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


def record(outputs, records: MutableMapping[str, torch.Tensor], input_ids, skip=()) -> None:
    """Store each ``(name, tensor)`` of ``outputs`` (``returned_outputs``), sampled at the check's positions
    in float64 on the CPU, into ``records`` (names in ``skip`` left out). Token ids say which axes are
    (batch, position); for other inputs (``ExampleInputs``: a waveform, an image) a flat sample is kept."""
    batch, seq = input_ids.shape if isinstance(input_ids, torch.Tensor) else (0, 0)
    positions = sample_positions(seq)
    for name, t in outputs:
        if name not in skip:
            records[name] = _sample(t, batch, seq, positions)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((b - a).norm() / a.norm().clamp(min=1e-300)).item()


def describes_conversion(sites) -> bool:
    """Whether ``sites`` record what a conversion did (some norm folded or swapped: ``convert``'s, a saved
    output's manifest), rather than the original's (``inspect``'s, plain names, none): only then can an
    unexplained change be called a failure."""
    return any(getattr(s, "folded", False) or getattr(s, "swapped", False) for s in sites or ())


def judge(
    reference: Mapping[str, torch.Tensor],
    converted: Mapping[str, torch.Tensor],
    *,
    rtol: float,
    own: Mapping[str, float] | None = None,
    k: float = 0.0,
    transform: StreamTransform | None = None,
    producers: Mapping[str, str] | None = None,
    sites=(),
    keep_hidden_states: bool = False,
) -> tuple[list[OutputContract], list[str]]:
    """The contract entry of every recorded output, and the check failures it implies.

    Args:
        reference, converted: ``record``'s mappings of the original (float32-upcast for half precision) and
            the converted model.
        rtol, own, k: the threshold at an output is ``rtol + k * own[output]`` (localization's rule:
            ``own`` is the original's own relative error in half precision).
        transform: the stream transform the conversion made by design, or None.
        producers: output name -> the norm site (in the converted model) whose output it is.
        sites: the ``NormSite`` records after conversion (``folded``, consumers). Without records of a
            conversion (none given, or none folded or swapped: ``inspect``'s, taken before) nothing is known
            of it: an unexplained change is reported (``changed``) but fails nothing.
        keep_hidden_states: every output must be ``same``; anything else fails.

    Returns:
        ``(entries, failures)``: one ``OutputContract`` per reference output, in order; failure lines.
    """
    by_name = {s.name: s for s in sites or ()}
    known = describes_conversion(by_name.values())
    entries, failures = [], []
    for name, ref in reference.items():
        conv = converted.get(name)
        threshold = rtol + (k * own.get(name, 0.0) if own else 0.0)
        if conv is None or conv.shape != ref.shape:
            entry = OutputContract(name, CHANGED, float("nan"), float("inf"), threshold,
                                   reason="the converted model does not return it")  # fmt: skip
            entries.append(entry)
            failures.append(f"{name}: the converted model does not return it with the original's shape")
            continue
        rel = _rel(ref, conv)
        entry = OutputContract(name, SAME, (conv - ref).abs().max().item(), rel, threshold)
        entries.append(entry)
        if rel <= threshold:
            continue
        site = by_name.get((producers or {}).get(name))
        if transform is not None and transform.apply is None:  # its map is not known: not compared
            entry.status, entry.reason, entry.relation = BY_DESIGN, transform.reason, transform.name
            if keep_hidden_states:
                failures.append(f"{name} changed ({entry.reason}); keep_hidden_states asks it to stay")
            continue
        if transform is not None:
            image = transform.apply(ref)
            error = _rel(image, conv)
            if error <= threshold:
                entry.status, entry.reason = BY_DESIGN, transform.reason
                entry.relation, entry.relation_error, entry.file = transform.name, error, transform.file
        if entry.status == SAME and site is not None and (site.folded or site.scale_folded):
            consumers = ", ".join(sorted({c.module for c in site.consumers})) or "its consumers"
            offset = " (1 + w)" if site.offset else ""
            entry.status = BY_DESIGN
            entry.reason = f"the weight{offset} of norm {site.name} is folded into {consumers}"
            if not site.folded:
                entry.reason += " (its bias, divided by the weight, kept on the norm)"
            if transform is not None and transform.name == "rotated":  # a norm's output commutes with Q
                entry.reason += ", and it is rotated with the stream (times Q)"
        if entry.status == SAME:
            entry.status = CHANGED
            if not known and not keep_hidden_states:
                entry.reason = "no record of what the conversion did (its sites, normswap.json) to tell why"
                continue
            failures.append(
                f"{name} differs from the original's (relative error {rel:.3g} > {threshold:.3g}) and no "
                "conversion step explains it"
            )
        elif keep_hidden_states:
            failures.append(f"{name} changed ({entry.reason}); keep_hidden_states asks it to stay the same")
    return entries, failures


def lines(contract: list[dict], check: dict | None = None) -> list[str]:
    """The contract for a reader: runs of consecutive outputs with the same verdict share one line
    (``hidden_states[0..29]  same (max diff 0.0039, relative 1.9e-06)``: the largest of each).

    ``check``: the ``CheckResult.to_dict()`` the contract belongs to. For a half-precision one (bfloat16,
    float16), "same" is "same within that precision's rounding", and the line says what holds: the main
    output's largest difference from the original, then the converted and the original model's own largest
    difference from the float32-upcast original (the check's rule compares those two); another output's
    largest and relative difference from the float32-upcast original (what it is judged on, as
    ``judge`` records it) and the bound it is within, ``localize_rtol + k x`` the original's own relative
    error there (the largest of the run, from each output's ``threshold``). Numbers get 3 significant
    digits there (2 in float32).
    """
    check = check or {}
    dtype = check.get("dtype")
    half = dtype in ("bfloat16", "float16")
    digits = ".3g" if half else ".2g"
    groups: list[tuple[list[str], dict]] = []
    for i, entry in enumerate(contract):
        key = (entry["status"], entry.get("reason"))
        if i > 1 and (groups[-1][1]["status"], groups[-1][1].get("reason")) == key:  # the main one alone
            group = groups[-1][1]
            groups[-1][0].append(entry["output"])
            group["max_abs_diff"] = max(group["max_abs_diff"], entry["max_abs_diff"])
            group["rel_error"] = max(group["rel_error"], entry["rel_error"])
            if group.get("threshold") is not None and entry.get("threshold") is not None:
                group["threshold"] = max(group["threshold"], entry["threshold"])
        else:
            groups.append(([entry["output"]], dict(entry)))
    out = []
    for names, entry in groups:
        label = _span(names)
        diff = format(entry["max_abs_diff"], digits)
        if entry["status"] == SAME and half:
            verdict = f"same within {dtype} rounding ({_half_detail(entry, check, diff)})"
        elif entry["status"] == SAME:
            rel = "" if entry.get("rel_error") is None else f", relative {entry['rel_error']:{digits}}"
            verdict = f"same (max diff {diff}{rel})"
        elif entry["status"] == BY_DESIGN:
            verdict = f"changed by design: {entry['reason']}"
            if entry.get("file"):
                verdict += f" ({entry['file']})"
        else:
            verdict = f"CHANGED (max diff {diff}): {entry.get('reason') or 'not explained'}"
        out.append(f"{label}  {verdict}")
    width = max((len(line.split("  ", 1)[0]) for line in out), default=0)
    return [f"{a.ljust(width)}  {b}" for a, b in (line.split("  ", 1) for line in out)]


def _half_detail(entry: dict, check: dict, diff: str) -> str:
    """The numbers of a half-precision "same" (see ``lines``), 3 significant digits."""
    if entry.get("rel_error") is None:  # the main output, judged by the check's float32-reference rule
        errors = check.get("half_precision") or {}
        conv = (errors.get("converted") or {}).get("max_abs")
        own = (errors.get("original") or {}).get("max_abs")
        if conv is None or own is None:
            return f"max diff {diff}"
        return f"max diff {diff}; vs float32 {conv:.3g}, the original's own {own:.3g}"
    detail = f"vs float32: max diff {diff}, relative {entry['rel_error']:.3g}"
    tolerance = check.get("tolerance") or {}
    k, rtol, threshold = tolerance.get("k"), tolerance.get("localize_rtol"), entry.get("threshold")
    if k and rtol is not None and threshold is not None:
        own = max(threshold - rtol, 0.0) / k
        detail += f" <= {rtol:.3g} + {k:.3g} x the original's own {own:.3g}"
    return detail


def _span(names: list[str]) -> str:
    """``["hidden_states[0]", ..., "hidden_states[29]", "model.last_hidden_state"]`` ->
    ``"hidden_states[0..29], model.last_hidden_state"``: consecutive indices of one name as a range."""
    runs: list[list] = []  # [stem, first, last] or [name]
    for name in names:
        stem, _, index = name.rpartition("[")
        number = index[:-1] if name.endswith("]") and stem else ""
        if number.isdigit() and runs and len(runs[-1]) == 3 and runs[-1][0] == stem:
            if int(runs[-1][2]) + 1 == int(number):
                runs[-1][2] = number
                continue
        runs.append([stem, number, number] if number.isdigit() else [name])
    parts = []
    for run in runs:
        if len(run) == 1:
            parts.append(run[0])
        else:
            stem, first, last = run
            parts.append(f"{stem}[{first}]" if first == last else f"{stem}[{first}..{last}]")
    return ", ".join(parts)
