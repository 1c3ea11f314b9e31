"""Divergence localization: where, in execution order, the converted model first stops matching.

Probe points, chosen from the norm sites:

* the input of every norm (the residual stream or branch value it normalizes; a fold or swap never
  changes it, so a mismatch here means the change happened upstream), except for a per-channel map folded
  into the producer of its input (whose output then changes by design): its output instead;
* the output of every consumer module of a norm (q/k/v, gate/up, lm_head, ...: after a fold these
  must still match, as the norm's scale now lives in their weights), but not of a module that is also
  the producer a per-channel map folded into;
* the output of norms that are not folded (a swap alone must keep the output);
* the output of every decoder layer (modules whose class is in ``model._no_split_modules``).

Temporary forward hooks record each point while the model runs and are removed afterwards. To keep the
lean path lean, each record keeps only a sample of token positions (at most :data:`MAX_POSITIONS`,
evenly spaced, the last one included) in float64: ``O(points x positions x width)`` memory, about 5 MB
for SmolLM2-135M. A fold error hits every token, so the sample sees it; a point diverges when
``||conv - ref||_F / ||ref||_F`` over the sample exceeds the dtype's ``localize_rtol``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass

import torch

MAX_POSITIONS = 32
_MAX_FLAT = 4096  # elements kept from a tensor whose shape has no token axis


@dataclass(frozen=True)
class Probe:
    """One point to record: ``module``'s input or output, and the norm site it belongs to."""

    module: str
    where: str  # "input" or "output"
    role: str  # "norm input", "norm output", "consumer output", "layer output"
    site: str | None


def _site_name(site) -> str:
    return site if isinstance(site, str) else site.name


def plan_probes(model: torch.nn.Module, sites) -> list[Probe]:
    """Probe points for ``sites`` (module names or ``NormSite`` records) plus decoder-layer outputs.

    Names missing from ``model.named_modules()`` are skipped. With plain names the consumers are
    unknown, so only norm inputs and layer outputs are probed.
    """
    modules = dict(model.named_modules())
    probes: list[Probe] = []
    # producers that take a per-channel map's fold: their outputs change by design, never probed as consumers
    producers = {p.module for s in sites or [] if (p := getattr(s, "producer", None)) is not None}
    for site in sites or []:
        name = _site_name(site)
        into_producer = getattr(site, "producer", None) is not None
        if not into_producer:  # a fold into the producer of a norm's input changes that input by design
            probes.append(Probe(name, "input", "norm input", name))
        if isinstance(site, str):
            continue
        if (not site.foldable and not site.folded) or into_producer:
            probes.append(Probe(name, "output", "norm output", name))
        for consumer in dict.fromkeys(c.module for c in site.consumers):
            if consumer not in producers:
                probes.append(Probe(consumer, "output", "consumer output", name))
    layer_classes = set(getattr(model, "_no_split_modules", None) or [])
    for name, module in modules.items():
        if type(module).__name__ in layer_classes and "embed" not in type(module).__name__.lower():
            probes.append(Probe(name, "output", "layer output", None))
    return [p for p in dict.fromkeys(probes) if p.module in modules]


def sample_positions(seq_len: int) -> torch.Tensor:
    """At most MAX_POSITIONS token positions in ``[0, seq_len)``, evenly spaced, first and last included."""
    return torch.linspace(0, seq_len - 1, min(seq_len, MAX_POSITIONS), device="cpu").round().long().unique()


def _first_tensor(value):
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (tuple, list)):
        for v in value:
            if isinstance(v, torch.Tensor):
                return v
    return None


def _sample(t: torch.Tensor, batch: int, seq: int, positions: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    if t.ndim >= 2 and t.shape[0] == batch and t.shape[1] == seq:
        return t[:, positions.to(t.device)].to("cpu", torch.float64)
    if t.ndim >= 1 and t.shape[0] == batch * seq:
        return t.reshape(batch, seq, *t.shape[1:])[:, positions.to(t.device)].to("cpu", torch.float64)
    if t.ndim >= 2:  # whole rows (features last), so a per-row transform such as centering still applies
        return t.reshape(-1, t.shape[-1])[: max(1, _MAX_FLAT // max(1, t.shape[-1]))].to("cpu", torch.float64)
    return t.reshape(-1)[:_MAX_FLAT].to("cpu", torch.float64)


class Capture:
    """Context manager: records the probes' sampled tensors during forwards run inside it.

    ``records`` maps ``"module:where#call"`` to a float64 tensor, in firing order (dicts keep order). It is
    a new dict, or ``records`` when given (any mutable mapping that keeps insertion order, e.g.
    ``normswap.stream.records.DiskRecords``, which keeps the tensors on disk).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        probes: list[Probe],
        input_ids: torch.Tensor,
        records: MutableMapping[str, torch.Tensor] | None = None,
    ):
        self.model, self.probes = model, probes
        # token ids say which axes are (batch, position); other inputs (ExampleInputs): flat samples
        self.batch, self.seq = input_ids.shape if isinstance(input_ids, torch.Tensor) else (0, 0)
        self.positions = sample_positions(self.seq)
        self.records: MutableMapping[str, torch.Tensor] = {} if records is None else records
        self._handles: list = []
        self._calls: dict[str, int] = {}

    def _hook(self, name: str, wheres: tuple[str, ...]):
        def hook(module, args, kwargs, output):
            call = self._calls.get(name, 0)
            self._calls[name] = call + 1
            for where in wheres:
                value = _first_tensor(output) if where == "output" else _first_tensor(list(args) or kwargs)
                if value is not None and value.is_floating_point():
                    self.records[f"{name}:{where}#{call}"] = _sample(
                        value, self.batch, self.seq, self.positions
                    )

        return hook

    def __enter__(self) -> Capture:
        modules = dict(self.model.named_modules())
        wheres: dict[str, list[str]] = {}
        for p in self.probes:
            wheres.setdefault(p.module, []).append(p.where)
        for name, ws in wheres.items():
            hook = self._hook(name, tuple(dict.fromkeys(ws)))
            self._handles.append(modules[name].register_forward_hook(hook, with_kwargs=True))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


def layer_index(name: str) -> int | None:
    """First integer component of a module name (``"model.layers.12.mlp"`` -> 12), else ``None``."""
    m = re.search(r"(?:^|\.)(\d+)(?:\.|$)", name)
    return int(m.group(1)) if m else None


def _action(site) -> str:
    if site is None or isinstance(site, str):
        return "unknown (no NormSite record given)"
    into = "its producer" if getattr(site, "producer", None) is not None else "its consumers"
    done = [w for w, flag in ((f"folded into {into}", site.folded), ("swapped", site.swapped)) if flag]
    text = " and ".join(done) if done else "left unchanged"
    return f"{text} ({site.reason})" if site.reason else text


def _folded_since(site) -> bool:
    """Whether a norm whose output is probed (not foldable when the reference was taken) had its scale
    folded into its consumers after all: centering gives a LayerNorm's bias a place to go; a rotation folds
    the scale of a norm that keeps (a multiple of) its bias (``scale_folded``)."""
    if site is None or isinstance(site, str) or getattr(site, "producer", None) is not None:
        return False
    return bool(site.folded or getattr(site, "scale_folded", False))


def rel_errors(ref: Mapping[str, torch.Tensor], other: Mapping[str, torch.Tensor]) -> dict[str, float]:
    """``||other - ref||_F / ||ref||_F`` per record key (``inf`` where missing or of another shape); reads
    one record of each at a time."""
    out = {}
    for key, a in ref.items():
        b = other.get(key)
        ok = b is not None and b.shape == a.shape
        out[key] = ((b - a).norm() / a.norm().clamp(min=1e-300)).item() if ok else float("inf")
    return out


def localize(
    probes: list[Probe],
    ref: Mapping[str, torch.Tensor],
    conv: Mapping[str, torch.Tensor],
    rtol: float,
    sites=(),
    own: dict[str, float] | None = None,
    k: float = 0.0,
    transform=None,
) -> dict | None:
    """First probe point, in the reference's execution order, whose relative error exceeds its threshold.

    Args:
        probes: the plan both captures used.
        ref, conv: ``Capture.records`` of the original (float32-upcast for half precision) and the converted
            model.
        rtol: threshold on ``||conv - ref||_F / ||ref||_F``; with ``own``, the absolute term of it.
        sites: ``NormSite`` records (or names) used to describe the site: consumers and what was done.
        own, k: half precision: the original's own relative error per record against the upcast reference;
            the threshold at a point is then ``k * own[point] + rtol`` (the logits policy, per point).
        transform: the conversion's change of the residual stream by design (``contract.StreamTransform``,
            e.g. centering): a norm's input or output, or a layer's output, also matches when it equals the
            transformed original (like with like); the inputs of ``transform.rewritten_inputs`` are not
            compared. Consumer outputs take it only where the consumer writes the stream
            (``transform.writers``). A transform whose map is not known (``transform.apply`` None: a
            rotation's ``Q`` missing) leaves every such record of the stream out.

    Returns:
        ``None`` when every point matches, else a dict: ``site``, ``layer``, ``point`` (``"module:where"``),
        ``role``, ``rel_error``, ``threshold``, ``consumers``, ``action``, ``last_match``, ``suspect`` and a
        one-line ``description``. A diverging "norm input" or "layer output" means the change happened
        upstream, after ``last_match``; ``suspect`` is then the last norm site that still matched (the
        change is in it or in what follows it), else the diverging site itself.
    """
    by_key = {(p.module, p.where): p for p in probes}
    site_by_name = {_site_name(s): s for s in sites or ()}
    last_match = suspect = None
    for key, rel in rel_errors(ref, conv).items():
        module, rest = key.split(":", 1)
        where = rest.split("#", 1)[0]
        probe = by_key.get((module, where))
        if probe is not None and probe.role == "norm output" and _folded_since(site_by_name.get(probe.site)):
            continue  # its scale now lives in its consumers (whose outputs are compared): not comparable
        if transform is not None and probe is not None and module in transform.not_compared:
            continue  # centered per head by design: the per-head norms' inputs are compared after it
        threshold = rtol + (k * own.get(key, 0.0) if own else 0.0)
        stream = probe is not None and (
            probe.role in ("norm input", "norm output", "layer output")
            or (transform is not None and probe.role == "consumer output" and module in transform.writers)
        )
        if transform is not None and stream and transform.apply is None:
            continue  # the stream's map is not known (a rotation's Q missing): not compared
        if transform is not None and stream and rel > threshold:
            if probe.role == "norm input" and probe.site in transform.rewritten_inputs:
                rel = 0.0  # rewritten by design (a table the norm reads); its output is compared
            elif key in conv and conv[key].shape == ref[key].shape:
                rel = min(rel, rel_errors({key: transform.apply(ref[key])}, {key: conv[key]})[key])
        if rel <= threshold:
            last_match = key
            suspect = probe.site if probe and probe.site else suspect
            continue
        site = site_by_name.get(probe.site) if probe and probe.site else None
        consumers = (
            sorted({c.module for c in site.consumers})
            if site is not None and not isinstance(site, str)
            else []
        )
        role = probe.role if probe else where
        name = probe.site if probe and probe.site else module
        if last_match is None:  # the very first point differs: nothing before it was recorded
            upstream = "before the first recorded point (in the embeddings or whatever runs before it)"
        else:
            upstream = f"after {last_match}" + (
                f", so in or after norm {suspect} and its consumers" if suspect else ""
            )
        if role == "norm input":
            what = f"the input of norm {name} already differs: the change is upstream, {upstream}"
        elif role == "layer output":
            what = f"the output of layer {module} differs first: the change is {upstream}"
        else:
            what = f"{role} {module} of norm {name} differs; {name} was {_action(site)}"
        return {
            "site": name,
            "layer": layer_index(module),
            "point": f"{module}:{where}",
            "role": role,
            "rel_error": rel,
            "threshold": threshold,
            "consumers": consumers,
            "action": _action(site) if probe and probe.site else None,
            "last_match": last_match,
            "suspect": suspect if role in ("norm input", "layer output") else name,
            "description": f"{what} (relative error {rel:.3g} > {threshold:.3g})",
        }
    return None
