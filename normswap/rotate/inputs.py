"""What a rotated model expects as ``inputs_embeds``, and the map from the original model's vectors onto it.

A caller who bypasses the input embedding table -- ``inputs_embeds``, soft prompts, a vision projector's
outputs placed among the token embeddings -- computed its vectors in the original model's embedding space
and must map them the way the conversion changed the table. The map is read from what the conversion did
to that table, never from the architecture:

1. centering (a LayerNorm model is centered before it is rotated) changed the table as its own transform
   says (``normswap.center.inputs``: ``center``, ``rewrite`` for an embedding norm such as BLOOM's,
   ``none`` where a map that reads the table was centered in its place);
2. the rotation multiplied the table along its features by ``Q`` (``e -> e Q``, on index groups where the
   table's features reach the stream reordered), or left it alone where the table is not written into the
   stream (OPT's ``project_in`` reads it, and is rotated instead: ``e -> e``).

So, for an original vector ``e`` (features last): ``e -> rotate(centering(e))``, each step only where the
conversion made it. Per model (measured on the tiny zoo models, tests/test_rotate.py): Llama, Gemma (its
``sqrt(hidden)`` embedding scale commutes with ``Q``): ``e Q``; GPT-2, OPT (without ``project_in``):
``(e - mean(e)) Q``; BLOOM: the centering's table rewrite, then ``Q``; OPT with ``project_in``: unchanged.

``describe`` records the map (JSON-ready) once the rotation is applied; ``prove`` runs it on the check's ids
(the converted model given the mapped ``inputs_embeds`` must reproduce the original's logits within the
check's tolerance) and gives the file ``FILE`` to write beside the checkpoint; ``load`` reads it back with
the matrix from ``normswap.rotate.ROTATION_FILE``, and ``apply`` maps ``(..., D)`` vectors.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

FILE = "normswap/inputs_embeds.json"  # beside the rotation's matrices (normswap.rotate.ROTATION_FILE)


def _embedding_names(model: nn.Module) -> tuple[torch.Tensor | None, list[str]]:
    """The input embedding table and every name it has in ``model`` (tied holders included)."""
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    weight = getattr(embedding, "weight", None)
    if not isinstance(weight, torch.Tensor):
        return None, []
    return weight, [n for n, p in model.named_parameters(remove_duplicate=False) if p is weight]


def _groups_json(groups) -> list[list[int]] | None:
    return None if groups is None else [[int(i) for i in g.tolist()] for g in groups]


def _formula(centering: dict | None, rotation: dict | None) -> str:
    kind = (centering or {}).get("kind")
    inner = {"center": "(e - e.mean(-1, keepdim=True))", "rewrite": "rewrite(e)"}.get(kind, "e")
    if rotation is None:
        return f"e -> {inner}"
    where = "" if rotation["index"] is None else " (on the index groups of 'rotation')"
    return f"e -> {inner} @ Q{where}"


def describe(model: nn.Module, rotation, centering: dict[str, Any] | None = None) -> dict[str, Any]:
    """The ``inputs_embeds`` map of a rotated ``model``, from what the conversion did to its input table.

    Args:
        model: the model after the rotation (``normswap.rotate.fold_and_rotate``; in memory or streamed).
        rotation: the ``normswap.rotate.Rotation`` applied (its ``tensors`` say what happened to the table).
        centering: the centering's own ``inputs_embeds`` transform (``normswap.center.inputs.describe``,
            ``CenterResult.inputs``) when the model was centered before the rotation, else None.

    Returns:
        JSON-ready: ``embedding`` (the table's name), ``centering`` (step 1, or None), ``rotation``
        (``{"matrix": "Q", "file", "index"}``: step 2, or None where the table was not rotated), ``map`` (the
        formula), ``inputs_embeds`` (a sentence); ``kind`` is ``"map"``, or ``"unknown"`` (with the reason
        in ``inputs_embeds``) where no exact map is known: no input table, or a change of the table other
        than a rotation along its features.
    """
    from normswap.rotate import ROTATION_FILE

    weight, names = _embedding_names(model)
    base = {"file": FILE, "embedding": names[0] if names else None}
    if weight is None:
        return base | {"kind": "unknown", "inputs_embeds": "the model has no input embedding table"}
    if centering is not None and centering.get("kind") not in ("center", "rewrite", "none"):
        return base | {"kind": "unknown", "inputs_embeds": f"centering: {centering.get('inputs_embeds')}"}
    if centering is not None:  # the centering's own step; its hidden-state sentence is the rotation's here
        centering = {k: v for k, v in centering.items() if k not in ("hidden_states", "verified")}
    record = next((t for t in rotation.tensors if t.name in names), None)
    step = None
    if record is not None:
        last = weight.ndim - 1
        other = record.scale is not None or record.divide is not None or record.shift is not None
        if other or len(record.rotations) != 1 or record.rotations[0][:2] != (last, "Q"):
            return base | {
                "kind": "unknown",
                "inputs_embeds": f"the rotation changed the input table {names[0]} otherwise than along its "
                f"features by Q ({record.to_dict()}): no exact map of inputs_embeds is known",
            }
        step = {"matrix": "Q", "file": ROTATION_FILE, "index": _groups_json(record.rotations[0][2])}
    formula = _formula(centering, step)
    if step is None and (centering or {}).get("kind") in (None, "none"):
        also = " (and centered)" if centering is not None else ""
        sentence = (
            f"unchanged ({formula}): the input table {names[0]} is not written into the residual stream, a "
            f"map that reads it was rotated{also} in its place"
        )
    else:
        done = {
            "center": "centered (as --norm rmsnorm does)",
            "rewrite": f"rewritten for the embedding norm {(centering or {}).get('norm')} (as --norm rmsnorm "
            "does; its parameters are under 'centering')",
        }.get((centering or {}).get("kind"))
        parts = [f"the input table {names[0]} was"] + ([done] if done else [])
        if step is not None:
            parts[-1] += "," if done else ""
            parts.append(("then " if done else "") + f"rotated by Q ({ROTATION_FILE})")
        sentence = f"{formula}: {' '.join(parts)}; normswap.rotate.inputs.apply maps a vector"
    return base | {"kind": "map", "map": formula, "centering": centering, "rotation": step,
                   "inputs_embeds": sentence}  # fmt: skip


@torch.no_grad()
def apply(transform: dict[str, Any], embeds: torch.Tensor, matrices: dict[str, torch.Tensor] | None = None):
    """Map original-space ``embeds`` (``(..., D)``, any float dtype and device) to what the rotated model
    expects as ``inputs_embeds``; same shape, dtype and device (float64 arithmetic, rounded once).

    Args:
        transform: ``describe``'s map, or ``load``'s (which holds the matrices).
        embeds: the original model's vectors (``model.get_input_embeddings()(ids)`` of the original).
        matrices: ``{"Q": (D, D)}`` float tensors; default the ones ``load`` read.

    Raises:
        ValueError: the map is ``"unknown"``, or a centering step cannot map a vector (see
            ``normswap.center.inputs.apply``).
        KeyError: the matrix is neither given nor loaded.
    """
    from normswap.center.inputs import apply as centering_apply

    if transform.get("kind") != "map":
        raise ValueError(f"no exact inputs_embeds map: {transform.get('inputs_embeds')}")
    x = embeds.double()
    if transform.get("centering"):
        x = centering_apply(transform["centering"], x)
    step = transform.get("rotation")
    if step:
        q = (matrices if matrices is not None else transform["matrices"])[step["matrix"]]
        q = q.to(x.device, torch.float64)
        if step["index"] is None:
            x = x @ q
        else:
            x = x.clone()
            for g in step["index"]:
                g = torch.tensor(g, device=x.device)
                x[..., g] = x[..., g] @ q
    return x.to(embeds.dtype)


def load(folder: str | os.PathLike) -> dict[str, Any]:
    """Read the map of a rotated model's directory (``FILE``), with the matrix it needs from
    ``normswap.rotate.ROTATION_FILE`` under ``"matrices"`` (float64 tensors), ready for ``apply``.

    Raises:
        FileNotFoundError: the directory lacks ``FILE`` (not rotated, or copied without its ``normswap/``
            folder) or the matrices its map needs; the message names the file.
    """
    from safetensors.torch import load_file

    from normswap.rotate import ROTATION_FILE

    path = Path(folder) / FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: not a rotated model, or copied without its normswap/")
    transform = json.loads(path.read_text())
    step = transform.get("rotation")
    if step:
        file = Path(folder) / step.get("file", ROTATION_FILE)
        if not file.is_file():
            raise FileNotFoundError(f"{file} is missing: the inputs_embeds map needs its {step['matrix']}")
        transform["matrices"] = {step["matrix"]: load_file(str(file))[step["matrix"]]}
    return transform
