"""Records that flow through the pipeline: what the walk found, what each step decided and did.

Every record is a plain dataclass with ``to_dict()`` so reports serialize to JSON. A ``NormSite`` is what
the walk measured, never changed after the walk made it; each later verdict on it (``Decision``) and each
change made to the norm (``Action``) is a record of its own, appended by the step that made it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

NORM_KINDS = ("rmsnorm", "layernorm")  # normalize over the last axis (probe.py); swapped for a fused module
AFFINE_KINDS = ("batchnorm", "affine")  # a fixed per-channel affine map (affine.py); folded or left in place


@dataclass(frozen=True)
class Consumer:
    """One op that uses a norm's output as the input of a linear map (or, as a site's ``producer``, whose
    output is the norm's input).

    Attributes:
        module: name of the module executing the op (``"model.layers.0.self_attn.q_proj"``).
        param: qualified name of the weight parameter the op multiplies by.
        op: the op seen in the trace (``"linear"``, ``"addmm"``, ``"matmul"``, ``"grouped_mm"``,
            ``"conv1d"``, ...).
        axis: axis of the weight parameter that is contracted with the norm's feature axis (for a producer:
            the weight's axis that gives the output channels).
        bias: qualified name of the bias parameter the op adds, or ``None``.
        groups: a convolution's ``groups`` (its weight is ``(out, in / groups, *kernel)``); 1 otherwise.
        zero_pad: a convolution that pads its input with zeros (``padding`` > 0): a per-channel shift of
            its input would not reach the padded border, so only a scale folds into it exactly.
    """

    module: str
    param: str
    op: str
    axis: int
    bias: str | None = None
    groups: int = 1
    zero_pad: bool = False


DECIDED = ("foldable", "reason", "producer", "consumers")  # what a step may decide about a site
DONE = ("folded", "scale_folded", "swapped", "kind")  # what a step may do to its norm


@dataclass(frozen=True)
class Decision:
    """What one step decided about a site: new values of fields among ``DECIDED``.

    Attributes:
        step: the step that decided (``"walk"``, ``"fold plan"``, ``"untie proof"``, ``"carried tensors"``,
            ``"affine fold plan"``, ``"centering"``, ``"rotation"``, ``"convert"``).
        values: ``(field, value)`` pairs, e.g. ``(("foldable", False), ("reason", "..."))``.
    """

    step: str
    values: tuple[tuple[str, Any], ...]


@dataclass(frozen=True)
class Action:
    """What one step did to a site's norm: new values of fields among ``DONE`` (``folded``: its affine
    parameters now live in its consumers; ``kind``: centering made a LayerNorm an RMSNorm; ...).

    Attributes:
        step: the step that acted (``"fold"``, ``"affine fold"``, ``"rotation"``, ``"centering"``,
            ``"swap"``).
        values: ``(field, value)`` pairs, e.g. ``(("folded", True),)``.
    """

    step: str
    values: tuple[tuple[str, Any], ...]


_LATER = frozenset(DECIDED + DONE)


@dataclass(frozen=True)
class NormSite:
    """One normalization module, its semantics as measured by probing, and what was decided and done.

    The fields are what the walk found; a site is never changed once made. Each later verdict is a
    ``Decision`` and each change to the norm an ``Action``, appended to ``records`` by ``decide`` and
    ``act``: reading a field of ``DECIDED`` or ``DONE`` gives the value of the last record that set it, else
    the field's own value. ``dataclasses.replace(site, ...)`` makes a new site from the values as they read
    now, with no records (the walk and the probe build sites that way before any step records on them).

    The module computes, over the last axis of its input ``x`` (shape ``(..., D)``)::

        rmsnorm:   y = x / sqrt(mean(x**2) + eps) * (offset + weight)
        layernorm: y = (x - mean(x)) / sqrt(var(x) + eps) * (offset + weight) + bias

    or, per channel ``c`` along the input's axis ``axis`` (``normswap.affine``)::

        batchnorm: y = (x - mean[c]) / sqrt(var[c] + eps) * weight[c] + bias[c]   (eval mode)
        affine:    y = x * weight[c] + bias[c]                                    (MobileBERT's NoNorm)

    Attributes:
        name: module name in ``model.named_modules()``.
        kind: ``"rmsnorm"`` or ``"layernorm"`` (``NORM_KINDS``); ``"batchnorm"`` or ``"affine"``
            (``AFFINE_KINDS``: never swapped, folded into a producer or consumers where exact).
        offset: 0.0 for the ``w`` convention, 1.0 for Gemma's ``(1 + w)``.
        eps: the epsilon the module really uses (measured, not read from the config).
        weight: attribute name of the scale parameter on the module, or ``None`` (parameter-free).
        bias: attribute name of the bias parameter, or ``None``.
        shape: shape of the scale parameter, or ``(D,)`` for a parameter-free norm.
        cast_order: ``"llama"`` (normalize in float32, cast to the input dtype, then multiply by the
            weight) or ``"fp32"`` (multiply in float32, cast to the input dtype at the end).
        dtype: dtype of the scale parameter (or of the input, for a parameter-free norm), e.g.
            ``"float32"``.
        consumers: the linear ops that read this norm's output.
        foldable: whether the affine parameters can be folded into ``consumers`` exactly.
        folded: whether convert folded them (the norm then holds its identity parameters).
        scale_folded: whether only the scale was folded and the norm kept (a multiple of) its bias (a rotated
            LayerNorm model whose head has no bias to absorb it: the bias is kept on the norm and rotated).
        reached: False for a norm the trace never ran (a VLM's vision tower on a text-only trace), found by
            probing each idle module on an input shaped like its parameters; it is swapped, never folded.
        swappable: False for a module that is not a plain norm although it probes as one on its own (called
            with a gate or another input): it is listed but left in place.
        swapped: whether convert replaced the module by a fused one.
        reason: why the norm is not foldable or was not folded, ``None`` otherwise.
        compute_dtype: ``"float32"`` when the module normalizes float64 inputs in float32 too (HF's norms,
            which upcast with ``.to(torch.float32)``/``.float()``); ``None`` when it computes in float64
            for float64 inputs (``nn.LayerNorm``, ``nn.RMSNorm``). Half precision is always float32.
        axis: for ``AFFINE_KINDS``, the channel axis of the input as the trace saw it (1 for a BatchNorm on
            ``(B, C, T)``, 2 for NoNorm on ``(B, T, C)``); ``None`` for norms (always the last axis).
        mean: attribute name of the running-mean buffer (``batchnorm``), or ``None``.
        var: attribute name of the running-variance buffer (``batchnorm``), or ``None``.
        producer: the linear map or convolution whose output is this site's only input, when the site
            folds into it (``AFFINE_KINDS``: its output channels are scaled, its bias shifted); ``None``
            when the site folds into ``consumers`` or not at all.
        stats: for ``AFFINE_KINDS``, what the probe measured: ``input_shape`` (as traced), ``scale`` and
            ``shift`` (``[min, max]`` of the per-channel map ``y = x * scale + shift``), ``mean`` and
            ``var`` (``[min, max]`` of the running statistics), all from the unconverted module.
        records: the ``Decision`` and ``Action`` records made after the site, in order (not in
            ``to_dict``: the report holds the values they leave).
    """

    name: str
    kind: str
    offset: float
    eps: float
    weight: str | None
    bias: str | None
    shape: tuple[int, ...]
    cast_order: str
    dtype: str
    consumers: list[Consumer] = field(default_factory=list)
    foldable: bool = False
    folded: bool = False
    scale_folded: bool = False
    reached: bool = True
    swappable: bool = True
    swapped: bool = False
    reason: str | None = None
    compute_dtype: str | None = None
    axis: int | None = None
    mean: str | None = None
    var: str | None = None
    producer: Consumer | None = None
    stats: dict[str, Any] | None = None
    records: list[Decision | Action] = field(default_factory=list, init=False, compare=False, repr=False)

    def __post_init__(self):
        object.__setattr__(self, "consumers", tuple(self.consumers))

    def __getattribute__(self, name: str):
        if name in _LATER:
            for record in reversed(object.__getattribute__(self, "records")):
                for key, value in record.values:
                    if key == name:
                        return value
        return object.__getattribute__(self, name)

    def as_found(self) -> NormSite:
        """A new site with this one's fields as the walk made them: no record applied."""
        return NormSite(**{f.name: object.__getattribute__(self, f.name) for f in fields(self) if f.init})

    def decide(self, step: str, **values) -> None:
        """Record what ``step`` decided: ``values`` maps fields of ``DECIDED`` to their new values."""
        self._record(Decision, DECIDED, step, values)

    def act(self, step: str, **values) -> None:
        """Record what ``step`` did to the norm: ``values`` maps fields of ``DONE`` to their new values."""
        self._record(Action, DONE, step, values)

    def _record(self, kind, allowed: tuple[str, ...], step: str, values: dict[str, Any]) -> None:
        unknown = sorted(values.keys() - set(allowed))
        if unknown:
            raise TypeError(f"{kind.__name__} cannot set {', '.join(unknown)}")
        if "consumers" in values:
            values["consumers"] = tuple(values["consumers"])
        self.records.append(kind(step, tuple(values.items())))

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        del d["records"]
        d["shape"] = list(self.shape)
        d["consumer_ops"] = list(d.pop("consumers"))
        d["consumers"] = sorted({c.module for c in self.consumers})
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> NormSite:
        d = dict(d)
        d.pop("consumers", None)
        ops = [Consumer(**c) for c in d.pop("consumer_ops", [])]
        d["shape"] = tuple(d["shape"])
        if d.get("producer") is not None:
            d["producer"] = Consumer(**d["producer"])
        return cls(consumers=ops, **d)
