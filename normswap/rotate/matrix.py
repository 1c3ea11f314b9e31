"""The orthogonal matrices a rotation applies: randomized Hadamard or seeded random orthogonal, float64.

* ``"hadamard"``: ``Q = diag(s) H / sqrt(n)`` with ``H`` from ``hadamard.hadamard(n)`` and random signs
  ``s`` (QuaRot's randomized Hadamard, Ashkboos et al. 2024, sec. 4); where no construction reaches ``n``,
  the ``"random"`` matrix instead, and ``Matrix.description`` says so;
* ``"random"``: the Q factor of the QR decomposition of a standard Gaussian matrix, with the signs of
  ``diag(R)`` moved into Q so that the distribution is uniform (Haar) on the orthogonal group (Mezzadri,
  "How to generate random matrices from the classical compact groups", Notices AMS 54, 2007, sec. 5).

``keep_ones=True`` (LayerNorm models, whose residual stream normswap centers): ``Q = Q0 R`` with ``R`` the
Householder reflection that sends ``u = 1/sqrt(n)`` to ``Q0ᵀ u``, so ``Q u = Q0 Q0ᵀ u = u``: ``Q 1 = 1``
and ``Qᵀ 1 = 1``. A zero-mean row ``h`` then stays zero-mean (``(h Q) 1 = h 1 = 0``) and
``LayerNorm(h Q) = LayerNorm(h) Q`` for a LayerNorm with weight 1 and bias 0, so the stock modules stay exact.

Randomness comes from one ``torch.Generator`` on the CPU seeded with the user's seed, drawn in a fixed
order (the hidden matrix first, then the per-head matrix), so a seed gives the same matrices on every
machine and whether or not the head rotation is asked for.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from normswap.rotate.hadamard import hadamard

KINDS = ("hadamard", "random")


@dataclass
class Matrix:
    """One orthogonal matrix of a rotation.

    Attributes:
        name: its tensor name in the saved file (``"Q"``, ``"H"``).
        values: ``(n, n)`` float64 on the CPU, orthogonal to float64 rounding.
        kind: ``"hadamard"`` or ``"random"``: what was built (``"random"`` also where a Hadamard matrix
            was asked for and no construction reaches ``n``).
        description: how it was built, for the report.
        keeps_ones: whether ``Q 1 = 1`` (the Householder adjustment).
    """

    name: str
    values: torch.Tensor
    kind: str
    description: str
    keeps_ones: bool = False
    _sha256: str | None = field(default=None, repr=False, compare=False)

    @property
    def size(self) -> int:
        return self.values.shape[0]

    @property
    def sha256(self) -> str:
        """SHA-256 of ``values`` as saved: contiguous float64, little-endian, row-major (the bytes of its
        tensor in ``normswap.rotate.ROTATION_FILE``); ``normswap check`` compares a saved file with it."""
        if self._sha256 is None:
            self._sha256 = digest(self.values)
        return self._sha256

    def to_dict(self) -> dict:
        return {"name": self.name, "size": self.size, "kind": self.kind, "description": self.description,
                "keeps_ones": self.keeps_ones, "sha256": self.sha256}  # fmt: skip


def digest(values: torch.Tensor) -> str:
    """SHA-256 of a tensor's float64 values, contiguous, little-endian, row-major (``Matrix.sha256``)."""
    import hashlib

    import numpy as np

    array = values.detach().to("cpu", torch.float64).contiguous().numpy().astype("<f8", copy=False)
    return hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()


def random_orthogonal(n: int, gen: torch.Generator) -> torch.Tensor:
    """A Haar-random ``(n, n)`` orthogonal float64 matrix (QR of a Gaussian, signs fixed; Mezzadri 2007)."""
    q, r = torch.linalg.qr(torch.randn((n, n), generator=gen, dtype=torch.float64, device="cpu"))
    return q * torch.sign(torch.diagonal(r)).where(torch.diagonal(r) != 0, 1.0)


def householder_ones(q0: torch.Tensor) -> torch.Tensor:
    """``q0 @ R`` with ``R`` the Householder reflection sending ``u = 1/sqrt(n)`` to ``q0ᵀ u``: the result
    maps the all-ones vector to itself (``Q 1 = 1``, and ``Qᵀ 1 = 1`` as ``Q`` is orthogonal)."""
    n = q0.shape[0]
    u = torch.full((n,), 1.0 / math.sqrt(n), dtype=torch.float64, device="cpu")
    v = u - q0.T @ u
    norm2 = float(v @ v)
    if norm2 < 1e-30:  # q0 already keeps u
        return q0.clone()
    return q0 - (2.0 / norm2) * torch.outer(q0 @ v, v)  # q0 (I - 2 v vᵀ / vᵀv)


def make(name: str, n: int, kind: str, gen: torch.Generator, keep_ones: bool = False) -> Matrix:
    """Build one matrix (see the module docstring).

    Args:
        name: its tensor name (``"Q"``, ``"H"``).
        n: its order.
        kind: ``"hadamard"`` or ``"random"``.
        gen: the CPU generator the random signs or the Gaussian are drawn from.
        keep_ones: apply the Householder adjustment so that ``Q 1 = 1``.

    Raises:
        ValueError: unknown ``kind`` or ``n < 1``.
    """
    if kind not in KINDS:
        raise ValueError(f"rotation kind must be one of {KINDS}, got {kind!r}")
    if n < 1:
        raise ValueError(f"matrix order must be positive, got {n}")
    built = hadamard(n) if kind == "hadamard" else None
    if built is not None:
        h, recipe = built
        signs = torch.randint(0, 2, (n,), generator=gen, device="cpu").to(torch.float64) * 2 - 1
        values = signs[:, None] * h / math.sqrt(n)
        made, description = "hadamard", f"randomized Hadamard diag(s) H / sqrt({n}), H = {recipe}"
    else:
        values = random_orthogonal(n, gen)
        made = "random"
        description = "random orthogonal (QR of a Gaussian, signs fixed)"
        if kind == "hadamard":
            description += f": no Hadamard construction here reaches order {n}"
    if keep_ones:
        values = householder_ones(values)
        description += "; Householder-adjusted so that Q 1 = 1"
    return Matrix(name, values, made, description, keep_ones)


def generator(seed: int) -> torch.Generator:
    """The CPU generator every matrix of one rotation is drawn from, in order."""
    return torch.Generator(device="cpu").manual_seed(int(seed))
