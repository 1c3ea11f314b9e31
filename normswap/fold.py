"""Folding a norm's affine parameters into the linear maps that consume its output.

For a consumer ``z = W x (+ c)`` of a norm output ``x = n * (offset + w) + b`` (``n`` the normalized input),

    W x + c = (W diag(offset + w)) n + (W b + c)

so scaling the weight's input axis by ``offset + w`` and adding ``W b`` to the bias leaves ``z`` unchanged
while the norm keeps only ``n`` (weight at its identity ``1 - offset``, bias 0). All arithmetic runs in
float64 and is stored back in each parameter's dtype. Sharing is resolved first: a consumer weight that is
the same Parameter as another module's (tied embeddings) is given its own copy ("untied") before folding.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
from torch import nn

from normswap.reads import may_read_flag, tie_configs
from normswap.sites import NORM_KINDS, Consumer, NormSite
from normswap.walk import Walk


@dataclass
class FoldPlan:
    """What folding will do: the sites to fold and the parameters to untie first.

    Attributes:
        sites: sites that will be folded (``site.foldable`` and nothing in the way).
        untie: ``(module_name, attribute)`` pairs whose Parameter is shared and gets its own copy.
        untie_bytes: extra bytes the untied copies cost.
        needs_untie: the sites that fold only once ``untie`` is done: name -> their consumers before the plan
            gave them the untied copies (what they read if the untying is undone).
        may_read_flag: whether the walk's forward may have read ``tie_word_embeddings`` (``normswap.reads``);
            only then does ``untie_checked`` compare outputs before and after untying.
    """

    sites: list[NormSite] = field(default_factory=list)
    untie: list[tuple[str, str]] = field(default_factory=list)
    untie_bytes: int = 0
    needs_untie: dict[str, tuple[Consumer, ...]] = field(default_factory=dict)
    may_read_flag: bool = True


def plan(model: nn.Module, walk: Walk, untie: bool = True, read: Callable | None = None) -> FoldPlan:
    """Decide which foldable sites fold, and what must be untied; records on each blocked site a
    ``Decision`` (step ``"fold plan"``) with the reason, and on a site that folds once a weight is untied
    its consumers reading the untied copy.

    A site whose folded consumer weights (or biases) would not fit their dtype is blocked here, before
    anything is written (``unrepresentable``), so a refused fold never leaves an inf in the model.
    ``read(name)`` gives a parameter's values for that test (default ``model.get_parameter``; the
    streamed path reads them from the checkpoint).

    A consumer weight may be used by nothing but this site's consumer ops. If it is shared with another use
    (for example the input embedding tied to ``lm_head``), the consumer module gets its own copy when
    ``untie`` is true and the weight is held by several module attributes; otherwise the site is not folded.
    """
    result = FoldPlan(may_read_flag=may_read_flag(walk.config_reads))
    for site, reason in shared_norm_parameters(walk):
        site.decide("fold plan", foldable=False, reason=reason)
    foldable = [s for s in walk.sites if s.foldable and s.kind in NORM_KINDS]  # AFFINE_KINDS: affine_fold
    sites_of: dict[str, set[str]] = {}
    for site in foldable:
        for c in site.consumers:
            sites_of.setdefault(c.param, set()).add(site.name)
    for site in foldable:
        to_untie: list[tuple[str, str]] = []
        blocked = None
        for param in dict.fromkeys(c.param for c in site.consumers):
            module = next(c.module for c in site.consumers if c.param == param)
            own = sum(c.param == param for c in site.consumers)  # one record per op call
            uses = walk.param_uses.get(param, [])
            owners = walk.owners.get(param, [])
            owner = next(((m, a) for m, a in owners if m == module), None)
            elsewhere = [u for u in uses if u[1] != module]
            if len(sites_of[param]) > 1:
                others = sorted(sites_of[param] - {site.name})
                blocked = f"consumer weight {param} also consumes the norm {others[0]}"
            elif len(uses) > own:
                user = f"{elsewhere[0][0]} in {elsewhere[0][1]}" if elsewhere else f"another call of {module}"
                if not untie and elsewhere:
                    blocked = f"consumer weight {param} is shared with {user} (untying disabled)"
                elif owner is None or len(owners) < 2 or not elsewhere:
                    blocked = f"consumer weight {param} is also used by {user}"
                elif owner not in to_untie:
                    to_untie.append(owner)
            if blocked:
                break
        blocked = blocked or unrepresentable(model, site, read)
        if blocked:
            site.decide("fold plan", foldable=False, reason=blocked)
            continue
        if to_untie:  # after untying, each such consumer's weight is its own attribute
            result.needs_untie[site.name] = site.consumers
            site.decide("fold plan", consumers=[_untied(c, walk, to_untie) for c in site.consumers])
        for owner in to_untie:
            if owner not in result.untie:
                result.untie.append(owner)
                p = model.get_submodule(owner[0])._parameters[owner[1]]
                result.untie_bytes += p.numel() * p.element_size()
        result.sites.append(site)
    while late := [(s, r) for s, r in shared_norm_parameters(walk) if any(s is x for x in result.sites)]:
        for site, reason in late:  # a holder of its Parameter was blocked above: none of them folds
            result.sites = [x for x in result.sites if x is not site]
            site.decide("fold plan", foldable=False, reason=reason)
    return result


def _untied(c: Consumer, walk: Walk, to_untie: list[tuple[str, str]]) -> Consumer:
    """``c`` reading the weight its module holds once ``to_untie`` is untied (its own attribute)."""
    owner = next(((m, a) for m, a in walk.owners.get(c.param, []) if m == c.module), None)
    if owner not in to_untie:
        return c
    return replace(c, param=f"{owner[0]}.{owner[1]}" if owner[0] else owner[1])


def shared_norm_parameters(walk: Walk) -> list[tuple[NormSite, str]]:
    """Foldable sites whose own weight or bias is also held or read outside the norms that fold with it,
    each with the reason (naming the holders) why it must not fold (case C34).

    A fold resets the norm's parameters to the identity after multiplying them into its consumers. When one
    Parameter is held by several norm modules (cross-layer tied norm weights) and every holder folds, each
    consumer takes the value from before any reset (``convert`` reads every scale first) and the reset is
    the same for all: that folds once, exactly. When a holder does not fold (it is not a norm, or its own
    fold is blocked), or another module's forward reads the Parameter (``walk.param_uses``), the reset would
    change that computation: every site holding it is refused.
    """
    site_at = {(s.name, attr): s for s in walk.sites for attr in (s.weight, s.bias) if attr}
    blocked: dict[str, tuple[NormSite, str]] = {}
    for qual, holders in walk.owners.items():
        sites = [site_at.get(h) for h in holders]
        group = [s for s in sites if s is not None]
        if not any(s.foldable for s in group):
            continue
        norms = {s.name for s in group}
        others = [f"{m}.{a}" if m else a for (m, a), s in zip(holders, sites, strict=True) if s is None]
        users = sorted({mod or "the model's forward" for _, mod in walk.param_uses.get(qual, [])} - norms)
        stuck = sorted(s.name for s in group if not s.foldable)
        if others:
            why = f"is also held by {', '.join(others)}"
        elif users:
            why = f"is also read in {', '.join(users)}"
        elif stuck:
            why = f"is shared with the norm {', '.join(stuck)}, which does not fold"
        else:
            continue  # held by this norm alone, or by norms that all fold: folds once, exactly
        holders_text = ", ".join(sorted(norms))
        for site in group:
            if site.foldable and site.name not in blocked:
                reason = f"parameter {qual} (held by {holders_text}) {why}: a fold would reset it there too"
                blocked[site.name] = (site, reason)
    return list(blocked.values())


@dataclass
class Untied:
    """Parameters given their own storage, with what is needed to undo it.

    Attributes:
        names: qualified names of the new Parameters.
    """

    names: list[str] = field(default_factory=list)
    _replaced: list[tuple[nn.Module, str, nn.Parameter]] = field(default_factory=list, repr=False)
    _configs: list[object] = field(default_factory=list, repr=False)

    def restore(self) -> None:
        """Put the shared Parameters and the config flags back exactly as they were."""
        for module, attr, old in self._replaced:
            setattr(module, attr, old)
        for config in self._configs:
            config.tie_word_embeddings = True
        self.names, self._replaced, self._configs = [], [], []


def _clone(name: str, old: nn.Parameter) -> nn.Parameter:
    return nn.Parameter(old.detach().clone(), requires_grad=old.requires_grad)


def untie_parameters(
    model: nn.Module,
    owners: list[tuple[str, str]],
    copy: Callable[[str, nn.Parameter], nn.Parameter] | None = None,
) -> Untied:
    """Give each ``(module_name, attribute)`` its own copy of the Parameter it shares.

    The other holders keep the original Parameter object, bit-identical. When the shared Parameter was the
    input embedding, every ``tie_word_embeddings`` flag in the config becomes False so a saved checkpoint
    loads untied. ``copy(qualified_name, old)`` makes the new Parameter (default: a clone of the values;
    ``normswap.stream`` passes a placeholder read from the checkpoint).
    """
    copy = copy if copy is not None else _clone
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    untied = Untied()
    for module_name, attr in owners:
        module = model.get_submodule(module_name)
        old = module._parameters[attr]
        name = f"{module_name}.{attr}" if module_name else attr
        setattr(module, attr, copy(name, old))
        untied._replaced.append((module, attr, old))
        untied.names.append(name)
        if embedding is not None and getattr(embedding, "weight", None) is old:
            untied._configs.extend(untie_config(model))
    return untied


def untie_config(model: nn.Module) -> list[object]:
    """Set every ``tie_word_embeddings`` flag of the model's config (and text config) to False.

    Returns the config objects whose flag was flipped.
    """
    flipped = []
    for cfg in tie_configs(model):
        if getattr(cfg, "tie_word_embeddings", False):
            cfg.tie_word_embeddings = False
            flipped.append(cfg)
    return flipped


PROOF_POSITIONS = 8  # positions of the untie proof's two forwards, for token ids


@torch.no_grad()
def untie_checked(model: nn.Module, folding: FoldPlan, inputs=None, copy=None) -> Untied:
    """Untie what ``folding`` needs, after proving that untying alone changes nothing.

    Some models read ``tie_word_embeddings`` while running (T5-style decoders rescale their output when it is
    True), so flipping the flag can change the function even before any fold. When the walk's forward read
    neither the flag nor a config's whole state (``folding.may_read_flag`` False), the function cannot
    depend on the flag and the untied copies hold the same values: untied at once. Otherwise two forwards,
    before and after untying, are compared. ``inputs``: the walk's
    inputs (``normswap.walk.example_inputs``); token ids are cut to their first ``PROOF_POSITIONS``
    (``normswap.walk.short_inputs``): a flag read while running moves every position's output, and two
    forwards on the check's 512 tokens cost more than the rest of a conversion (Gemma 3's head alone, 640 x
    262144, is 86 G multiply-adds per forward). When the outputs differ, the untie is undone and the sites
    that needed it are dropped from ``folding`` with that reason. ``copy``: as in ``untie_parameters``.
    """
    if not folding.untie:
        return Untied()
    from normswap.walk import run_example, short_inputs

    if not folding.may_read_flag:
        return untie_parameters(model, folding.untie, copy)
    inputs = short_inputs(inputs, PROOF_POSITIONS)
    before = run_example(model, inputs)
    untied = untie_parameters(model, folding.untie, copy)
    if not untied._configs or _same(before, run_example(model, inputs)):
        return untied
    untied.restore()
    reason = "the model reads tie_word_embeddings while running; untying its lm_head would change its outputs"
    for site in [s for s in folding.sites if s.name in folding.needs_untie]:
        folding.sites.remove(site)
        site.decide("untie proof", foldable=False, reason=reason, consumers=folding.needs_untie[site.name])
    folding.untie, folding.untie_bytes = [], 0
    return untied


def _same(a, b) -> bool:
    from torch.utils._pytree import tree_flatten

    flat_a, flat_b = tree_flatten(a)[0], tree_flatten(b)[0]
    tensors = [(x, y) for x, y in zip(flat_a, flat_b, strict=False) if isinstance(x, torch.Tensor)]
    return len(flat_a) == len(flat_b) and all(x.shape == y.shape and torch.equal(x, y) for x, y in tensors)


def scale_and_shift(site: NormSite, module: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The norm's effective float64 scale ``offset + w`` (shape ``(D,)``; ones for a norm without a weight)
    and bias ``b`` (or None)."""
    b = getattr(module, site.bias).detach().double() if site.bias else None
    if site.weight:
        return getattr(module, site.weight).detach().double() + site.offset, b
    device = b.device if b is not None else "cpu"
    return torch.ones(site.shape, dtype=torch.float64, device=device), b


_CHUNK = 1 << 22  # elements per float64 block: bounds the temporary memory of a fold to 32 MiB


def _blocks(weight: torch.Tensor, axis: int):
    """Slices of ``weight`` along a dim other than ``axis``, each at most ~``_CHUNK`` elements."""
    dim = 0 if axis != 0 or weight.ndim == 1 else 1
    step = max(1, _CHUNK // max(1, weight.numel() // weight.shape[dim]))
    for start in range(0, weight.shape[dim], step):
        yield dim, start, min(step, weight.shape[dim] - start)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def distinct_consumers(site: NormSite):
    """``site``'s consumers, each ``(param, axis)`` once: a weight read by several op calls folds once."""
    seen: set[tuple[str, int]] = set()
    for c in site.consumers:
        if (c.param, c.axis) not in seen:
            seen.add((c.param, c.axis))
            yield c


@torch.no_grad()
def unrepresentable(model: nn.Module, site: NormSite, read: Callable | None = None) -> str | None:
    """Why folding ``site`` would store a value its consumers' dtypes cannot hold, or None when it can.

    Computes the folded weights' largest magnitudes (``input_peaks``; every folded entry, in float64
    blocks, for a weight that already holds a NaN or inf) and every folded bias exactly as ``fold_site``
    will, without writing anything: a consumer weight that is not a float (an integer weight dequantized in
    the forward) cannot take a fold at all, and a folded value beyond the dtype's finite range
    (``finfo.max``: 65504 for float16) would be stored as inf. Values that were already not finite before
    the fold are not counted.
    """
    read = read or model.get_parameter
    norm = model.get_submodule(site.name)
    scale, shift = scale_and_shift(site, norm)
    for c in distinct_consumers(site):
        weight = read(c.param)
        if not weight.is_floating_point():
            return (
                f"consumer weight {c.param} is stored as {_dtype_name(weight.dtype)}: a fold cannot be stored"
            )
        peaks = input_peaks(weight, c.axis)
        if peaks is not None:  # all finite: the largest magnitude per input index decides (input_peaks)
            parts = [(c.param, peaks, scale.to(weight.device).abs(), None)]
        else:
            shape = [1] * weight.ndim
            shape[c.axis] = -1
            parts = [
                (c.param, weight.narrow(dim, start, length), scale.to(weight.device).reshape(shape), None)
                for dim, start, length in _blocks(weight, c.axis)
            ]
        if shift is not None and c.bias is not None:
            bias = read(c.bias)
            delta = bias_delta(weight, shift, c.axis)
            if delta.shape == bias.shape:
                parts.append((c.bias, bias, None, delta))
        for name, before, factor, add in parts:
            after = before.double() * factor if factor is not None else before.double() + add
            limit = torch.finfo(before.dtype).max
            bad = (~torch.isfinite(after) | (after.abs() > limit)) & torch.isfinite(before)
            if bool(bad.any()):
                peak = after[bad].abs().max().item()
                return (
                    f"fold overflows {_dtype_name(before.dtype)} ({name} would need {peak:.3g} > {limit:.6g})"
                )
    return None


@torch.no_grad()
def input_peaks(weight: torch.Tensor, axis: int) -> torch.Tensor | None:
    """``max |weight|`` over every axis but ``axis``: a vector of ``weight.shape[axis]`` entries in the
    weight's dtype (each one of its entries' magnitudes, so exact), or None when ``weight`` holds a NaN or
    inf.

    Two reductions of the weight in its own dtype, with no temporary beyond the result. Scaling by ``s``
    along ``axis`` overflows iff ``peaks.double() * |s|`` does somewhere: float64 rounding is monotonic, so
    along each input index the largest product is the largest magnitude's, and ``unrepresentable`` decides
    exactly as it would element by element, at the cost of two reads of the weight. A weight with a
    ``rows()`` method (``normswap.stream``'s stack of experts, each ``(1, *rest)`` read as it is needed) is
    reduced row by row: the maximum of the rows' peaks, the same values.
    """
    rows = getattr(weight, "rows", None)
    if axis != 0 and callable(rows):  # a weight read one row at a time (a streamed stack of experts)
        peaks = None
        for row in rows():
            got = input_peaks(row, axis)
            if got is None:
                return None
            peaks = got if peaks is None else torch.maximum(peaks, got)
        return peaks
    dims = [d for d in range(weight.ndim) if d != axis]
    peaks = torch.maximum(weight.amax(dim=dims), weight.amin(dim=dims).neg()) if dims else weight.abs()
    return peaks if bool(torch.isfinite(peaks).all()) else None


@torch.no_grad()
def bias_delta(weight: torch.Tensor, shift: torch.Tensor, axis: int) -> torch.Tensor:
    """``W b``: the float64 vector a consumer's bias absorbs when the norm's bias ``shift`` folds into
    ``weight`` along its input axis ``axis`` (shape: ``weight``'s shape without ``axis``)."""
    return torch.tensordot(weight.detach().double(), shift.to(weight.device), dims=([axis], [0]))


@torch.no_grad()
def scale_axis_(weight: torch.Tensor, scale: torch.Tensor, axis: int) -> torch.Tensor:
    """Multiply ``weight`` along ``axis`` by the float64 vector ``scale``, in place, in float64 blocks.

    Each block is computed as ``block.double() * scale`` (in place on its float64 copy) and rounded back by
    ``copy_``, so the result is the rounded float64 product whatever the block size; the temporary memory
    is at most ``_CHUNK`` float64 elements.
    Returns ``weight``.
    """
    shape = [1] * weight.ndim
    shape[axis] = -1
    scale = scale.to(weight.device).reshape(shape)
    for dim, start, length in _blocks(weight, axis):
        block = weight.narrow(dim, start, length)
        block.copy_(block.double().mul_(scale))
    return weight


@dataclass(frozen=True)
class FoldChange:
    """One change the fold makes to one tensor: the record ``fold_changes`` makes and ``apply_change``
    applies, alike to a Parameter in memory and to a tensor read from a shard (``normswap.stream.plan``).

    Attributes:
        tensor: the changed tensor's name (a model parameter's, or a streamed output tensor's).
        site: the name of the norm whose fold requires the change.
        op: ``"absorb"`` (a consumer bias ``c <- c + W b``), ``"scale"`` (a consumer weight multiplied along
            ``axis`` by ``operand``) or ``"fill"`` (the norm's weight or bias set to its identity).
        operand: ``"scale"``: the float64 scale ``offset + w``, shape ``(D,)``; ``"absorb"``: the norm's
            float64 bias ``b``, ``(D,)``; ``"fill"``: the identity value (``1 - offset``, or 0).
        axis: the consumer weight's input axis (``"absorb"``, ``"scale"``); None for ``"fill"``.
        weight: ``"absorb"``: the name of ``W``, read before this site's scale changes it.
    """

    tensor: str
    site: str
    op: str
    operand: torch.Tensor | float
    axis: int | None = None
    weight: str | None = None


def fold_changes(site: NormSite, scale: torch.Tensor, shift: torch.Tensor | None) -> list[FoldChange]:
    """The changes folding ``site`` makes, in the order they apply: per distinct consumer, its bias absorbs
    ``W b`` (when the norm has a bias ``shift`` and the consumer a bias), then its weight is scaled by
    ``scale``; then the norm's weight and bias are set to their identity. ``scale``, ``shift``: the site's
    ``scale_and_shift``."""
    changes = []
    for c in distinct_consumers(site):
        if shift is not None and c.bias is not None:
            changes.append(FoldChange(c.bias, site.name, "absorb", shift, c.axis, weight=c.param))
        changes.append(FoldChange(c.param, site.name, "scale", scale, c.axis))
    if site.weight:
        changes.append(FoldChange(f"{site.name}.{site.weight}", site.name, "fill", 1.0 - site.offset))
    if site.bias:
        changes.append(FoldChange(f"{site.name}.{site.bias}", site.name, "fill", 0.0))
    return changes


@torch.no_grad()
def apply_change(t: torch.Tensor, change: FoldChange, read: Callable[[str], torch.Tensor] | None = None):
    """Apply ``change`` to ``t`` in place, rounding once into ``t``'s dtype: ``"absorb"`` adds the float64
    ``W b`` (``bias_delta`` of ``read(change.weight)``), ``"scale"`` is ``scale_axis_``, ``"fill"`` fills.

    Raises:
        ValueError: an ``"absorb"`` whose ``W b`` does not have ``t``'s shape (the fold would not be exact).
    """
    if change.op == "scale":
        scale_axis_(t, change.operand, change.axis)
    elif change.op == "fill":
        t.fill_(change.operand)
    else:
        t.copy_((t.detach().double() + absorbed(change, t.shape, read)).to(t.dtype))


def absorbed(change: FoldChange, shape: torch.Size, read: Callable[[str], torch.Tensor]) -> torch.Tensor:
    """The float64 ``W b`` an ``"absorb"`` change adds to a bias of shape ``shape`` (``W``:
    ``read(change.weight)``).

    Raises:
        ValueError: ``W b`` does not have ``shape`` (the fold would not be exact).
    """
    delta = bias_delta(read(change.weight), change.operand, change.axis)
    if delta.shape != shape:
        shapes = f"has shape {tuple(shape)}, W b has {tuple(delta.shape)}"
        raise ValueError(f"{change.site}: bias {change.tensor} {shapes}")
    return delta


def tensor_of(model: nn.Module, name: str) -> torch.Tensor:
    """The tensor a record names (``module.attribute``): a Parameter, or a buffer holding a norm scale."""
    module, _, attribute = name.rpartition(".")
    return getattr(model.get_submodule(module), attribute)


@torch.no_grad()
def fold_site(model: nn.Module, site: NormSite, scale_shift=None) -> None:
    """Fold one foldable site into its consumers and reset the norm to its identity parameters, in place
    (``fold_changes``, each applied by ``apply_change``).

    The float64 arithmetic runs in blocks of rows, so folding into a large ``lm_head`` costs at most a
    32 MiB temporary, not a float64 copy of the weight. ``scale_shift``: the site's ``scale_and_shift``
    taken before any site was folded (norms that share one Parameter fold with its original value; see
    ``shared_norm_parameters``); read from the norm now when None.

    Raises:
        ValueError: a consumer bias does not have the shape ``W b`` gives (the fold would not be exact).
    """
    norm = model.get_submodule(site.name)
    scale, shift = scale_shift if scale_shift is not None else scale_and_shift(site, norm)
    for change in fold_changes(site, scale, shift):
        apply_change(tensor_of(model, change.tensor), change, model.get_parameter)
    site.act("fold", folded=True)
