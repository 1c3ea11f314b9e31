"""Applying a plan atomically: ``prepare`` allocates, ``commit`` only assigns (docs/CENTERING.md).

``prepare`` computes every new tensor (untied copies, zero biases, centered weights, rewritten tables) without
changing the model and returns them as actions; ``commit`` applies the actions (attribute assignments and
same-shape copies, which cannot fail half-way) and records on the walk's sites what centering decided and did,
so that ``fold`` and ``swap`` see the centered model. An error before the commit leaves the model
bit-identical; the cost is a temporary copy of the written parameters.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from types import SimpleNamespace

import torch
from torch import nn

from normswap.center import rewrite
from normswap.center.plan import Plan
from normswap.center.rewrite import table_rows
from normswap.fold import untie_config
from normswap.sites import Consumer
from normswap.walk import Walk

Action = tuple  # ("untie", (module, attr), Parameter) | ("bias", (module, attr), Parameter)
#                 | ("flag", config attribute, True) | ("copy", target tensor, new values)
#                 | ("call", function of no arguments): a change ``defer`` made (streamed models)


def _clone(name: str, old: nn.Parameter) -> nn.Parameter:
    return nn.Parameter(old.detach().clone(), requires_grad=old.requires_grad)


def _fill(value: float):
    return lambda t: torch.full_like(t, value)


@torch.no_grad()
def prepare(
    model: nn.Module,
    plan: Plan,
    *,
    copy: Callable[[str, nn.Parameter], nn.Parameter] = _clone,
    defer: Callable[[torch.Tensor, Callable], Callable[[], None] | None] | None = None,
    read: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> list[Action]:
    """Allocate every new tensor of ``plan``; the model is not touched.

    Every change of a tensor's values is a function of its values alone (``rewrite.centered``,
    ``rewrite.table_rows``, a fill), so a model whose weights stay on disk can apply it as it reads them.

    Args:
        model: the planned model.
        plan: from ``plan_centering``; its ``result.tables`` entries get their scale appended.
        copy: ``copy(qualified name, old)`` makes an untied holder's own Parameter (default: a clone; as
            ``normswap.fold.untie_parameters``).
        defer: ``defer(target, op)`` may return a function that ``commit`` calls to make ``op`` (tensor ->
            new tensor of the same shape and dtype) part of ``target``'s values later; when it returns None
            (or without ``defer``) the new values are computed here. ``normswap.stream`` passes
            ``Streamed.transform`` this way.
        read: the values of a tensor whose whole is needed now (an embedding table's scale; default: the
            tensor itself).

    Returns:
        The actions ``commit`` applies, in order.

    Raises:
        CenteringError: a table that cannot be rewritten exactly (eps 0).
    """
    actions: list[Action] = []

    def change(target: torch.Tensor, op: Callable, value: torch.Tensor | None = None) -> None:
        later = defer(target, op) if defer is not None else None
        if later is not None:
            actions.append(("call", later))
        else:
            actions.append(("copy", target, op(target) if value is None else value))

    for module, attr in plan.untie:
        old = model.get_submodule(module)._parameters[attr]
        actions.append(("untie", (module, attr), copy(f"{module}.{attr}" if module else attr, old)))
    for flag in plan.flags:
        for mod_name, (attr, shape) in flag.biases.items():
            ref = next(model.get_submodule(mod_name).parameters())
            zeros = nn.Parameter(torch.zeros(shape, dtype=ref.dtype, device=ref.device))
            actions.append(("bias", (mod_name, attr), zeros))
        actions.append(("flag", flag.name, True))
    for (param, axis), groups in plan.groups.items():
        change(plan.tensors[param], lambda t, axis=axis, groups=groups: rewrite.centered(t, axis, groups))
    for i, (emb, (norm_name, site)) in enumerate(plan.tables.items()):
        norm = model.get_submodule(norm_name)
        table = plan.tensors[emb]
        rows, scale = table_rows(read(table) if read is not None else table, site, norm)
        frozen = SimpleNamespace(
            **{n: getattr(norm, n).detach().clone() for n in (site.weight, site.bias) if n}
        )
        change(table, lambda t, site=site, frozen=frozen: table_rows(t, site, frozen)[0], rows)
        if site.weight:
            change(getattr(norm, site.weight), _fill(scale - site.offset))
        if site.bias:
            change(getattr(norm, site.bias), _fill(0.0))
        plan.result.tables[i] += f" (constant scale {scale:g})"
        plan.scales[emb] = scale
    return actions


@torch.no_grad()
def commit(model: nn.Module, walk: Walk, plan: Plan, actions: list[Action]) -> None:
    """Apply the prepared actions, in place, and record them on the walk's sites (step ``"centering"``).

    Afterwards every planned site has ``kind == "rmsnorm"`` (an ``Action``); sites that the config flags
    made foldable are foldable, with the new biases on their consumers; a site that keeps its bias or reads
    a rewritten table says so in its ``reason`` (``Decision``s); untied parameters have their new names in
    ``walk``'s ``owners`` and ``param_uses`` and in the consumers of its sites.
    """
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    for kind, target, *rest in actions:
        value = rest[0] if rest else None
        if kind == "untie":
            module = model.get_submodule(target[0])
            shared = module._parameters[target[1]]
            name = next((n for n, holders in walk.owners.items() if target in holders), None)
            setattr(module, target[1], value)
            if name is not None:
                _retarget(walk, name, *target)
            if embedding is not None and getattr(embedding, "weight", None) is shared:
                untie_config(model)
        elif kind == "bias":
            model.get_submodule(target[0]).register_parameter(target[1], value)
        elif kind == "flag":
            setattr(model.config, target, value)
        elif kind == "call":
            target()
        else:
            target.copy_(value)
    for site in plan.resolved:
        site.decide("centering", foldable=True, reason=None,
                    consumers=[_with_flag_bias(c, plan.flags) for c in site.consumers])  # fmt: skip
    tables = {norm for norm, _ in plan.tables.values()}
    for site in walk.sites:
        if site.name not in plan.result.sites:
            continue
        site.act("centering", kind="rmsnorm")
        if site.name in plan.result.kept_bias:
            site.decide("centering", reason=f"bias kept on the RMSNorm: {site.reason}, and no config setting "
                        "adds one")  # fmt: skip
        if site.name in tables:
            site.decide("centering", reason=(
                "norm of an embedding lookup: the table was rewritten, the norm holds a constant scale"
            ))  # fmt: skip


def _with_flag_bias(c: Consumer, flags) -> Consumer:
    """``c`` with the bias a config flag of ``flags`` gave its module, if it had none."""
    for flag in flags:
        if c.bias is None and c.module in flag.biases:
            c = replace(c, bias=f"{c.module}.{flag.biases[c.module][0]}")
    return c


def _retarget(walk: Walk, shared: str, module: str, attr: str) -> None:
    """After ``module.attr`` got its own copy of ``shared``, point the walk's records at the new names."""
    mine = (module, attr)
    new = f"{module}.{attr}" if module else attr
    rest = [o for o in walk.owners.pop(shared, []) if o != mine]
    rest_name = shared if shared != new else (f"{rest[0][0]}.{rest[0][1]}" if rest else shared)
    uses = walk.param_uses.pop(shared, [])
    walk.owners[new] = [mine]
    walk.param_uses[new] = [u for u in uses if u[1] == module]
    if rest:
        walk.owners[rest_name] = rest
        walk.param_uses[rest_name] = [u for u in uses if u[1] != module]
    for site in walk.sites:
        if any(shared in (c.param, c.bias) for c in site.consumers):
            site.decide("centering", consumers=[_renamed(c, shared, new if c.module == module else rest_name)
                                                for c in site.consumers])  # fmt: skip


def _renamed(c: Consumer, old: str, new: str) -> Consumer:
    """``c`` with its weight or bias named ``new`` where it was ``old``."""
    return replace(c, param=new if c.param == old else c.param, bias=new if c.bias == old else c.bias)
