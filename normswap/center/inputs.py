"""What a centered model expects of the vectors given as ``inputs_embeds``, and the transform that maps the
original model's onto them.

Centering rewrites what the model writes into its residual stream, the input embedding table among it. A
caller who bypasses the table -- ``inputs_embeds``, soft prompts, a vision projector's outputs placed among
the token embeddings -- must apply the same change to its vectors, which it computed in the original
model's embedding space. Measured from the centering plan, per model:

* ``"center"``: the table was centered (its rows written straight into the stream: GPT-2, OPT, GPT-NeoX,
  Falcon, Phi, ...): ``e - e.mean(-1, keepdim=True)``;
* ``"rewrite"``: the table feeds an embedding LayerNorm that became an RMSNorm of constant weight ``s``
  (BLOOM): ``T = C(LN(e))`` with the original norm's ``offset + w``, ``b`` and eps, ``u = T / s``,
  ``e' = u * sqrt(eps / (1 - mean(u^2)))`` (``rewrite.rows_for``; docs/CENTERING.md);
* ``"none"``: the table is read by a map that was centered instead (OPT's ``project_in``): unchanged.

``describe`` records it (JSON-ready, the original norm's parameters as float64 lists) before the model is
changed; ``save`` writes ``centering.json`` into a converted model's directory, ``load`` reads it back, and
``apply`` maps original-space vectors of shape ``(..., D)`` for the converted model. ``normswap convert``
proves the transform (``normswap.check.maps.prove_centered``): the converted model given
``apply(original inputs_embeds)`` reproduces the original's logits within the check's tolerance (recorded
under ``verified``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from normswap.center.rewrite import rows_for

FILE = "centering.json"
HIDDEN_STATES = (
    "every hidden state of the residual stream is the original's minus its mean over the hidden axis "
    "(h - h.mean(-1, keepdim=True)); normswap.json's check.contract states it per output"
)


def _name_of(model: nn.Module, tensor: torch.Tensor) -> str | None:
    return next((n for n, p in model.named_parameters(remove_duplicate=False) if p is tensor), None)


def describe(model: nn.Module, plan) -> dict[str, Any]:
    """The ``inputs_embeds`` transform of ``plan`` (``center.plan.Plan``, after ``commit.prepare``, before
    ``commit.commit``: the embedding norm still holds its original parameters)."""
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    weight = getattr(embedding, "weight", None)
    table = _name_of(model, weight) if isinstance(weight, torch.Tensor) else None
    base = {"embedding": table, "hidden_states": HIDDEN_STATES}
    if table is None:
        return base | {"kind": "unknown", "inputs_embeds": "the model has no input embedding table"}
    if table in plan.tables:
        norm_name, site = plan.tables[table]
        norm = model.get_submodule(norm_name)
        w = getattr(norm, site.weight).detach().double() + site.offset if site.weight else None
        b = getattr(norm, site.bias).detach().double() if site.bias else None
        return base | {
            "kind": "rewrite",
            "norm": norm_name,
            "eps": site.eps,
            "scale": plan.scales[table],
            "weight": None if w is None else w.cpu().tolist(),
            "bias": None if b is None else b.cpu().tolist(),
            "inputs_embeds": (
                f"rewritten for the embedding norm {norm_name} (now an RMSNorm of constant weight "
                f"{plan.scales[table]:g}): T = C(LN(e)) with its original weight, bias and eps, "
                "u = T / scale, e' = u * sqrt(eps / (1 - mean(u^2))); normswap.center.inputs.apply does it"
            ),
        }
    if any(param == table for param, _ in plan.groups):
        return base | {
            "kind": "center",
            "inputs_embeds": "centered: e - e.mean(-1, keepdim=True) for every vector given as inputs_embeds "
            "(soft prompts, projector outputs), computed in the original model's embedding space",
        }
    return base | {
        "kind": "none",
        "inputs_embeds": "unchanged: the embedding is read by a map that was centered in its place",
    }


@torch.no_grad()
def apply(transform: dict[str, Any], embeds: torch.Tensor) -> torch.Tensor:
    """Map original-space ``embeds`` (``(..., D)``, any float dtype and device) to what the centered model
    expects as ``inputs_embeds``; same shape, dtype and device (float64 arithmetic).

    Raises:
        ValueError: ``transform`` is of an unknown kind, or a vector cannot be rewritten exactly for the
            embedding norm (its centered, scaled normal form has mean square >= 1: far outside the table).
    """
    kind = transform.get("kind")
    if kind == "none":
        return embeds
    x = embeds.double()
    if kind == "center":
        return (x - x.mean(-1, keepdim=True)).to(embeds.dtype)
    if kind == "rewrite":
        w, b = (
            None if transform[k] is None else torch.tensor(transform[k], dtype=x.dtype, device=x.device)
            for k in ("weight", "bias")
        )
        return rows_for(x, w, b, transform["eps"], transform["scale"]).to(embeds.dtype)
    raise ValueError(f"unknown inputs_embeds transform {kind!r}")


@torch.no_grad()
def original_embeds(model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor | None:
    """The original model's input embeddings of ``input_ids`` (``(B, T)`` ids -> ``(B, T, D)`` on the CPU, in
    the model's dtype), taken before centering to prove the transform; None without an input embedding."""
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if embedding is None:
        return None
    return embedding(input_ids.to(next(embedding.parameters()).device)).cpu()


def load(folder: str | os.PathLike) -> dict[str, Any]:
    """Read ``centering.json`` of a converted model's directory.

    Raises:
        FileNotFoundError: the directory holds no such file (the model was not centered).
    """
    return json.loads((Path(folder) / FILE).read_text())
