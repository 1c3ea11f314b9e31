"""What the user sees of a rotation: the CLI's ``rotated:`` lines and the check of the saved matrices."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


def summary_lines(rotation: dict[str, Any]) -> list[str]:
    """The ``rotated:`` lines of ``normswap convert`` from a report's ``rotation`` (``Rotation.to_dict``).

    Example::

        rotated:  Q 576 x 576: randomized Hadamard diag(s) H / sqrt(576), H = ... (seed 0)
                  61 stream norms, 212 tensors changed; saved as normswap/rotation.safetensors
                  hidden states are the original's times Q (changed by design)
    """
    q = rotation["matrices"]["Q"]
    lines = [
        f"rotated:  Q {q['size']} x {q['size']}: {q['description']} (seed {rotation['seed']})",
    ]
    heads = rotation["matrices"].get("H")
    if heads:
        lines.append(f"          heads: H {heads['size']} x {heads['size']}: {heads['description']}")
    learned = rotation.get("learned")
    if learned:
        lines.append(
            f"          learned for {learned['target']}: {learned['steps']} steps of {learned['batch']} x "
            f"{learned['length']} tokens of {learned['calibration']}, loss {learned['loss_first']:.4f} -> "
            f"{learned['loss_after_on_first_batch']:.4f} on the first batch ({learned['seconds']:.0f} s)"
        )
    norms, tensors = len(rotation["stream_norms"]), len(rotation["tensors"])
    lines.append(f"          {norms} stream norms, {tensors} tensors changed; saved as {rotation['file']}")
    centered = " (centered)" if rotation.get("centered") else ""
    lines.append(f"          hidden states are the original's{centered} times Q (changed by design)")
    lines.append("          " + inputs_line(rotation.get("inputs_embeds")))
    return lines


def inputs_line(inputs: dict[str, Any] | None) -> str:
    """What the rotated model expects as ``inputs_embeds``, in one line of ``normswap convert``'s summary,
    from the rotation's ``inputs_embeds`` map (``normswap.rotate.inputs.describe``), e.g.
    ``inputs_embeds: e -> (e - e.mean(-1, keepdim=True)) @ Q (normswap/inputs_embeds.json; proved on the
    check's ids: max |logit diff| 2.4e-07)``."""
    if not inputs:
        return "inputs_embeds: no map recorded"
    if inputs.get("kind") != "map":
        return f"inputs_embeds: no exact map known ({inputs.get('inputs_embeds')})"
    proof = inputs.get("verified")
    if proof is None:
        said = "not proved"
    elif proof.get("passed"):
        said = f"proved on the check's ids: max |logit diff| {proof['max_abs_diff']:.2g}"
    else:
        said = f"FAILED on the check's ids: max |logit diff| {proof['max_abs_diff']:.3g}"
    return f"inputs_embeds: {inputs['map']} ({inputs.get('file')}; {said})"


def check_saved(path: str | os.PathLike, rotation) -> list[str]:
    """Failures of the saved matrices of ``rotation`` (a ``Rotation``) in the checkpoint at ``path``: each
    must be there, float64, and bit-identical to the one applied. Empty when all is well."""
    import torch
    from safetensors.torch import load_file

    from normswap.rotate import ROTATION_FILE

    file = Path(path) / ROTATION_FILE
    if not file.is_file():
        return [f"{ROTATION_FILE} is missing"]
    saved = load_file(str(file))
    failures = []
    for name, tensor in rotation.saved_tensors().items():
        if name not in saved:
            failures.append(f"{ROTATION_FILE} lacks {name}")
        elif saved[name].dtype != torch.float64 or not torch.equal(saved[name], tensor):
            failures.append(f"{ROTATION_FILE}: {name} differs from the matrix applied")
    return failures


def rotate_reference(reference, rotation) -> int:
    """Map the records a check localizes with (``normswap.check.Reference.captures``, taken on the original)
    to what the rotated model computes there by design, in place, so that a correct rotation reports no
    divergence and a wrong one is still found where it starts.

    Mapped: the input of every stream norm and every decoder layer's output (the residual stream:
    ``Rotation.hidden_states``), the output of a consumer that also writes into the stream (a fused MoE
    experts module reads the norm and its down projections write the stream: its output is a stream value,
    mapped the same way), the output of a stream norm that is not folded (``y -> (y / g) Q`` for a norm
    that keeps its bias ``b / g``, ``y -> y Q`` for a weightless one), and with heads the output of each value
    projection (each head's features times ``H``). Records of another width are left alone.

    Returns:
        The number of records mapped.
    """
    plan = rotation.plan
    stream = set(plan.stream_sites)
    width = rotation.Q.shape[0]
    heads = {}
    if plan.heads is not None:
        for target in plan.heads.targets:
            if target.side == "head output" and target.holder[1] != "bias":
                heads[target.holder[0]] = target.groups
    writers = {t.module for t in plan.writers} | {t.holder[0] for t in plan.writers}
    captures = reference.captures
    mapped = 0
    for probe in reference.probes:
        prefix = f"{probe.module}:{probe.where}#"
        keys = [k for k in list(captures.keys()) if k.startswith(prefix)]
        for key in keys:
            x = captures[key]
            on_stream = (
                probe.role == "layer output"
                or (probe.role == "norm input" and probe.site in stream)
                or (probe.role == "consumer output" and probe.module in writers and probe.module not in heads)
            )
            if on_stream:
                if x.shape[-1] == width:
                    captures[key] = rotation.hidden_states(x)
                    mapped += 1
            elif probe.role == "norm output" and probe.site in stream and x.shape[-1] == width:
                scale = rotation.kept_scales.get(probe.site)
                y = x.double() / scale.to(x.device) if scale is not None else x.double()
                captures[key] = y @ rotation.Q.to(x.device)
                mapped += 1
            elif probe.role == "consumer output" and probe.module in heads:
                h = rotation.matrices["H"].values.to(x.device)
                y = x.double().clone()
                for g in heads[probe.module]:
                    if int(g.max()) < y.shape[-1]:
                        y[..., g] = y[..., g] @ h
                captures[key] = y
                mapped += 1
    return mapped
