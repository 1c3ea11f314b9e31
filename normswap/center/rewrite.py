"""The new tensor values, computed in float64 in blocks of ``CHUNK`` elements (32 MiB).

* ``centered``: a writer's parameter with each normalized group of its output axis minus its mean,
  ``W <- C W`` and ``c <- C c`` (SliceGPT, Ashkboos et al., 2024, sec. 3.2);
* ``table_rows``: the embedding table behind a LayerNorm of one lookup (BLOOM), rewritten so that the
  norm, as an RMSNorm of constant weight ``s``, returns the centered original rows exactly
  (docs/CENTERING.md, "BLOOM's embedding LayerNorm").

Both return new tensors; the model is not touched.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from normswap.center.errors import CenteringError
from normswap.sites import NormSite

CHUNK = 1 << 22  # float64 elements per block of centering arithmetic (32 MiB)


def centered(p: torch.Tensor, axis: int, groups: list[torch.Tensor]) -> torch.Tensor:
    """A new tensor: ``p`` with each index group along ``axis`` minus its mean (float64 arithmetic).

    Args:
        p: a parameter of any float dtype and shape.
        axis: the written (output) axis of ``p``.
        groups: 1-D int64 index tensors along ``axis``, disjoint; indices in no group are left alone.

    Returns:
        A tensor of ``p``'s shape, dtype and device.
    """
    out = p.detach().clone()
    if p.ndim == 1:
        blocks = [(None, 0, 1)]
    else:
        dim = 1 if axis == 0 else 0
        step = max(1, CHUNK // max(1, p.numel() // p.shape[dim]))
        blocks = [(dim, s, min(step, p.shape[dim] - s)) for s in range(0, p.shape[dim], step)]
    for dim, start, length in blocks:
        view = out if dim is None else out.narrow(dim, start, length)
        block = view.double()
        for g in groups:
            g = g.to(block.device)
            part = block.index_select(axis, g)
            block.index_copy_(axis, g, part - part.mean(axis, keepdim=True))
        view.copy_(block.to(p.dtype))
    return out


def table_rows(table: torch.Tensor, site: NormSite, norm: nn.Module) -> tuple[torch.Tensor, float]:
    """New rows ``E'`` and scale ``s`` with ``s * RMSNorm(E'[t]) == C LayerNorm(E[t])`` for every token.

    ``T = C LN(E)`` (rows centered) is what the stream must start from. With ``u = T / s`` and
    ``m = mean(u^2) < 1``, the row ``a * u`` with ``a = sqrt(eps / (1 - m))`` satisfies
    ``a * u / sqrt(a^2 m + eps) = u`` exactly, so an RMSNorm of weight ``s`` returns ``T``. ``s`` is the
    power of two at or above twice the largest row RMS of ``T`` (so ``m <= 1/4``), or 1 for a norm with
    no weight (whose rows already have ``m < 1``).

    Args:
        table: the ``(vocab, D)`` embedding table the norm reads.
        site: the LayerNorm's site (eps, offset, parameter names).
        norm: the LayerNorm module.

    Returns:
        ``(E', s)``: ``E'`` of ``table``'s shape and dtype.

    Raises:
        CenteringError: eps is 0 (no row can be exact).
    """
    eps = site.eps
    w = getattr(norm, site.weight).detach().double() + site.offset if site.weight else None
    b = getattr(norm, site.bias).detach().double() if site.bias else None
    step = max(1, CHUNK // table.shape[1])

    def target(rows: torch.Tensor) -> torch.Tensor:
        x = rows.double()
        n = (x - x.mean(-1, keepdim=True)) / torch.sqrt(x.var(-1, unbiased=False, keepdim=True) + eps)
        y = n * w if w is not None else n
        y = y + b if b is not None else y
        return y - y.mean(-1, keepdim=True)

    peak = 0.0
    for s in range(0, table.shape[0], step):
        peak = max(peak, target(table[s : s + step]).pow(2).mean(-1).max().item())
    scale = 2.0 ** math.ceil(math.log2(2 * math.sqrt(peak))) if w is not None and peak > 0 else 1.0
    out = torch.empty_like(table)
    for s in range(0, table.shape[0], step):
        try:
            out[s : s + step] = rows_for(table[s : s + step], w, b, eps, scale).to(table.dtype)
        except ValueError as error:
            raise CenteringError(f"cannot rewrite the table read by {site.name}: {error}") from error
    return out, scale


def rows_for(
    x: torch.Tensor, w: torch.Tensor | None, b: torch.Tensor | None, eps: float, scale: float
) -> torch.Tensor:
    """Rows ``x'`` (float64, ``x``'s shape ``(..., D)``) with ``scale * RMSNorm(x') == C(LN(x) * w + b)``.

    ``LN`` is the LayerNorm of eps ``eps`` (``w``: its effective scale ``offset + weight``, ``b`` its bias,
    either None when absent); ``C`` removes each row's mean. With ``u = C(LN(x)) / scale`` and
    ``m = mean(u^2)``, ``x' = u * sqrt(eps / (1 - m))`` (see ``table_rows``).

    Raises:
        ValueError: eps is 0, or a row has ``m >= 1`` (``scale`` too small for it): no exact row exists.
    """
    xd = x.double()
    n = (xd - xd.mean(-1, keepdim=True)) / torch.sqrt(xd.var(-1, unbiased=False, keepdim=True) + eps)
    y = n * w if w is not None else n
    y = y + b if b is not None else y
    u = (y - y.mean(-1, keepdim=True)) / scale
    m = u.pow(2).mean(-1, keepdim=True)
    if eps <= 0 or bool((m >= 1).any()):
        raise ValueError(f"eps {eps} and scale {scale:g} leave no exact row")
    return u * torch.sqrt(eps / (1 - m))
