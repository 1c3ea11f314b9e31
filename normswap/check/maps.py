"""The proofs of the ``inputs_embeds`` maps a conversion saves: the converted model given the mapped
original embeddings reproduces the original's outputs on the check's ids (``compare_inputs_embeds``).

A centered model's map is ``normswap.center.inputs`` (``centering.json``), a rotated model's
``normswap.rotate.inputs`` (``normswap/inputs_embeds.json``); each proof records its result in the map as
``verified`` and fails the check when the map does not hold.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from normswap.center import inputs as centered_map
from normswap.check.core import compare_inputs_embeds
from normswap.files import to_json
from normswap.rotate import inputs as rotated_map


def prove_centered(
    centering: dict[str, Any] | None, reference, model: nn.Module, embeds, checked
) -> dict[str, str]:
    """Prove the ``inputs_embeds`` transform of a centered conversion on the check's ids, and give the file
    to write beside the checkpoint.

    The converted ``model`` given ``normswap.center.inputs.apply(transform, embeds)`` must reproduce
    ``reference``'s outputs within the check's tolerance (``compare_inputs_embeds``); the result goes into
    the transform as ``verified``, and a failure fails ``checked`` (a ``check.core.CheckResult``: ``passed``
    set False, the reason appended to ``failures``).

    Args:
        centering: the report's ``centering`` entry (``CenterResult.to_dict()``), or None (not centered).
        reference: ``check.reference_outputs`` of the original on the check's ids.
        model: the converted model (in memory or streamed).
        embeds: ``normswap.center.inputs.original_embeds`` of the original, or None.
        checked: the check's result for ``model``.

    Returns:
        ``{"centering.json": JSON text}``, or ``{}`` when there is nothing to write (not centered, no
        embedding table).
    """
    transform = (centering or {}).get("inputs")
    if not transform or embeds is None or transform.get("kind") == "unknown":
        return {}
    proof = compare_inputs_embeds(reference, model, centered_map.apply(transform, embeds))
    transform["verified"] = proof
    if not proof["passed"]:
        checked.passed = False
        checked.failures.append(
            f"the inputs_embeds transform of {centered_map.FILE} does not hold: "
            + "; ".join(proof["failures"])
        )
    return {centered_map.FILE: to_json(transform)}


def prove_rotated(transform: dict[str, Any] | None, reference, model: nn.Module, embeds, matrices, checked):
    """Prove the ``inputs_embeds`` map of a rotated conversion on the check's ids, and give the file to
    write beside the checkpoint.

    The converted ``model`` given ``normswap.rotate.inputs.apply(transform, embeds)`` must reproduce
    ``reference``'s outputs within the check's tolerance (``compare_inputs_embeds``); the result goes into
    ``transform`` as ``verified``, and a failure fails ``checked`` (``passed`` set False, the reason appended
    to ``failures``).

    Args:
        transform: ``normswap.rotate.inputs.describe``'s map (``Rotation.inputs``), or None.
        reference: ``check.reference_outputs`` of the original on the check's ids.
        model: the converted model (in memory or streamed).
        embeds: ``normswap.center.inputs.original_embeds`` of the original (taken before converting), or
            None.
        matrices: ``{"Q": ...}`` as applied.
        checked: the check's ``CheckResult`` for ``model``.

    Returns:
        ``{"normswap/inputs_embeds.json": JSON text}``; ``{}`` without a map or without the original's
        embeddings.
    """
    if not transform or embeds is None:
        return {}
    if transform.get("kind") == "map":
        proof = compare_inputs_embeds(reference, model, rotated_map.apply(transform, embeds, matrices))
        transform["verified"] = proof
        if not proof["passed"]:
            checked.passed = False
            checked.failures.append(
                f"the inputs_embeds map of {rotated_map.FILE} does not hold: " + "; ".join(proof["failures"])
            )
    return {rotated_map.FILE: to_json(transform)}
