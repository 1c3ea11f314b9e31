"""Rotation of the residual stream after folding (QuaRot / SpinQuant R1, and R2 per attention head).

Once every norm on the residual stream is weightless, an orthogonal ``Q`` (hidden x hidden) applied to the
stream leaves the model's function unchanged: the embeddings and every writer into the stream write
``h Q`` instead of ``h``, every norm computes ``RMSNorm(h Q) = RMSNorm(h) Q``, and every reader of a norm
reads back through ``Qᵀ`` folded into its weight (Ashkboos et al., "SliceGPT", ICLR 2024, sec. 3; "QuaRot",
NeurIPS 2024, sec. 4; Liu et al., "SpinQuant", ICLR 2025, R1/R2). A Hadamard ``Q`` spreads activation
outliers, which is what makes low-bit activation quantization work (docs/ROTATION.md has the measurements).

The steps, one module each:

* ``hadamard``: Hadamard matrices from known constructions (Sylvester, Paley I/II, Kronecker products);
* ``matrix``: the orthogonal matrices (randomized Hadamard, or seeded random orthogonal), ``Q 1 = 1`` for
  LayerNorm models;
* ``plan``: the stream norms, writers and readers from the dataflow, and every refusal (``RotationError``),
  before anything changes;
* ``heads``: the per-head value/output rotation (``rotate_heads``);
* ``apply``: which tensor changes how (``plan_changes``, shared by the in-memory and the streamed
  conversion), the float64 arithmetic, each tensor rounded once; the record ``TensorRotation``;
* ``report``: the CLI's lines and the check of the saved matrices;
* ``learn``: ``rotate="learned"``: ``Q = Q0 R`` with ``R`` trained for a fake quantizer on calibration text,
  starting from the randomized Hadamard ``Q0`` (imported on use: it needs the quantizer).

``normswap.convert(model, rotate="hadamard")`` runs them around the fold (``fold_and_rotate``; a streamed
conversion runs the same on a model whose weights stay on disk); ``Rotation`` is what it returns
in ``ConvertReport.rotation``, and what the saved checkpoint holds (``ROTATION_FILE``, named in
``normswap.json``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from normswap.rotate.apply import Changes, TensorRotation, apply, plan_changes, transform
from normswap.rotate.matrix import KINDS, Matrix, generator, make
from normswap.rotate.plan import RotationError, RotationPlan, check_folding, plan_rotation
from normswap.rotate.report import check_saved, rotate_reference, summary_lines

__all__ = [
    "KINDS",
    "LEARNED",
    "ROTATION_FILE",
    "Changes",
    "Rotation",
    "RotationError",
    "RotationPlan",
    "TensorRotation",
    "apply",
    "check_folding",
    "check_saved",
    "fold_and_rotate",
    "make_matrices",
    "plan_changes",
    "plan_rotation",
    "rotate_reference",
    "summary_lines",
    "transform",
]

LEARNED = "learned"  # rotate="learned": Q learned from the randomized Hadamard one (normswap.rotate.learn)
ROTATION_FILE = "normswap/rotation.safetensors"  # in a subfolder: loaders that glob *.safetensors skip it
log = logging.getLogger("normswap")


def make_matrices(plan: RotationPlan, kind: str, seed: int) -> dict[str, Matrix]:
    """``{"Q": ...}`` (and ``"H"`` for the per-head rotation) for ``plan``, drawn from one generator of
    ``seed`` in that order; ``Q`` keeps the all-ones vector for a stream that LayerNorms read."""
    gen = generator(seed)
    matrices = {"Q": make("Q", plan.width, kind, gen, keep_ones=plan.keep_ones)}
    if plan.heads is not None:
        matrices["H"] = make("H", plan.heads.size, kind, gen)
    return matrices


@dataclass
class Rotation:
    """A rotation as applied: the matrices, and what was done to each tensor.

    Attributes:
        kind: the kind asked for (``"hadamard"``, ``"random"`` or ``"learned"``).
        seed: the generator's seed.
        matrices: ``"Q"`` (the residual stream's, hidden x hidden) and ``"H"`` (per head, with heads).
        tensors: one ``TensorRotation`` per changed tensor.
        plan: the ``RotationPlan`` it came from.
        centered: whether the conversion centered the stream first (a LayerNorm model).
        not_centered: why a LayerNorm model was not centered (then rotated uncentered, ``Q 1 = 1``), or None.
        inputs: what the rotated model expects as ``inputs_embeds``: the map from the original's vectors
            (``normswap.rotate.inputs.describe``, JSON-ready; ``verified`` once proved on the check's ids;
            saved as ``normswap.rotate.inputs.FILE``), or None before it is described.
        learned: for ``kind == "learned"``, how ``Q`` was learned (``normswap.rotate.learn.record``: the
            settings, calibration text, losses, time), JSON-ready; else None.
    """

    kind: str
    seed: int
    matrices: dict[str, Matrix]
    tensors: list[TensorRotation] = field(default_factory=list)
    plan: RotationPlan | None = None
    centered: bool = False
    not_centered: str | None = None
    kept_scales: dict[str, torch.Tensor] = field(default_factory=dict)  # kept-bias norm -> its float64 scale
    inputs: dict[str, Any] | None = None
    learned: dict[str, Any] | None = None

    @property
    def Q(self) -> torch.Tensor:  # noqa: N802 - the matrix's name in every paper
        """The residual stream's ``(hidden, hidden)`` float64 matrix."""
        return self.matrices["Q"].values

    def hidden_states(self, h: torch.Tensor) -> torch.Tensor:
        """What the rotated model's hidden state is for the original's ``h`` (features last): ``h Q``, after
        subtracting each row's mean for a centered (LayerNorm) model. Float64."""
        h = h.double()
        if self.centered:
            h = h - h.mean(-1, keepdim=True)
        return h @ self.Q.to(h.device)

    def inputs_embeds(self, embeds: torch.Tensor) -> torch.Tensor:
        """What the rotated model expects as ``inputs_embeds`` for the original's ``embeds`` (``(..., D)``,
        e.g. ``original.get_input_embeddings()(ids)``): the map ``inputs`` (``normswap.rotate.inputs.apply``;
        not always ``hidden_states``: BLOOM's table was rewritten for its embedding norm, OPT's
        ``project_in`` was rotated in the table's place). Same shape, dtype and device.

        Raises:
            ValueError: no map was described, or no exact map is known (``inputs["kind"] == "unknown"``).
        """
        from normswap.rotate.inputs import apply

        if self.inputs is None:
            raise ValueError("no inputs_embeds map was described for this rotation")
        return apply(self.inputs, embeds, {name: m.values for name, m in self.matrices.items()})

    def saved_tensors(self) -> dict[str, torch.Tensor]:
        """The tensors of ``ROTATION_FILE``: each matrix by its name, float64, contiguous, on the CPU."""
        return {name: m.values.contiguous().cpu() for name, m in self.matrices.items()}

    def to_dict(self) -> dict[str, Any]:
        plan = self.plan
        return {
            "kind": self.kind,
            "seed": self.seed,
            "file": ROTATION_FILE,
            "matrices": {name: m.to_dict() for name, m in self.matrices.items()},
            "hidden_states": (
                "every hidden state of the residual stream (output_hidden_states before the final norm) of "
                "the rotated model is the original's"
                + (" minus its mean over the features," if self.centered else "")
                + f" times Q (h -> h Q, Q in {ROTATION_FILE}); inputs_embeds: see inputs_embeds"
            ),
            "inputs_embeds": self.inputs,
            "centered": self.centered,
            "not_centered": self.not_centered,
            "stream_norms": list(plan.stream_sites) if plan else [],
            "table_norms": list(plan.table_sites) if plan else [],
            "kept_bias": list(plan.kept_bias) if plan else [],
            "returned": list(plan.returned) if plan else [],
            "tensors": [t.to_dict() for t in self.tensors],
            **({"learned": self.learned} if self.learned is not None else {}),
        }


def fold_and_rotate(model, plan: RotationPlan, sites, folding, kind: str, seed: int, *, defer=None,
                    read=None, matrices: dict[str, Matrix] | None = None) -> Rotation:  # fmt: skip
    """Fold the stream norms of ``folding`` and rotate ``model`` in place (``apply``); the ``Rotation``.

    Args:
        model: the model after centering and untying (``normswap.fold.untie_checked``), the rotation checked
            against ``folding`` (``check_folding``); no norm folded yet.
        plan: from ``plan_rotation``.
        sites: the walk's sites; the kept-bias norms get ``scale_folded`` and their reason.
        folding: ``normswap.fold.plan``: the stream norms it folds fold here, in the rotation's float64 pass
            (the caller folds the others).
        kind, seed: the matrices' (``make_matrices``).
        defer, read: as ``apply``'s (``normswap.stream.store.ShardStore`` passes them).
        matrices: the matrices to apply (``"Q"``, and ``"H"`` with heads; a learned ``Q``) instead of
            drawing them with ``make_matrices``.

    Raises:
        RotationError: a value would leave its dtype's range (``apply``; nothing changed when raised here).
    """
    from normswap.fold import scale_and_shift

    matrices = matrices if matrices is not None else make_matrices(plan, kind, seed)
    folded = {s.name for s in folding.sites} & set(plan.stream_sites)
    by_name = {s.name: s for s in sites}
    kept = {n: scale_and_shift(by_name[n], model.get_submodule(n))[0] for n in plan.kept_bias}
    tensors = apply(model, plan, sites, folded, matrices, defer=defer, read=read)
    for name in plan.kept_bias:
        site = by_name[name]
        site.act("rotation", scale_folded=True)
        site.decide("rotation", reason=f"scale folded, bias kept on the norm and rotated ({site.reason})")
    log.info("rotated the residual stream: %s", matrices["Q"].description)
    return Rotation(kind, seed, matrices, tensors, plan, kept_scales=kept)
