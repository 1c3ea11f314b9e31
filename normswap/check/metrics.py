"""Metrics between a reference output and a converted model's output, computed in float64.

Logits are compared row by row (one row per token position), in chunks of rows so that the float64
copies of a large-vocabulary model's logits never all exist at once. The reference side is either the
full logits or a :class:`LogitSummary` (the lean mode's cheap record of them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

TOP_K = 64  # tokens per position a LogitSummary keeps


@dataclass
class LogitSummary:
    """What the metrics need from reference logits of shape ``(N, V)``, at ``O(N * k)`` memory.

    Attributes:
        top_idx: ``(N, k)`` long, the ``k`` highest-logit token ids per row, best first.
        top_logit: ``(N, k)`` float64, their logits.
        lse: ``(N,)`` float64, ``logsumexp`` of the row.
        rest_logprob: ``(N,)`` float64, log of the probability mass outside the top ``k``.
        target_logprob: ``(N,)`` float64, log-probability of the next token (NaN where there is none).
    """

    top_idx: torch.Tensor
    top_logit: torch.Tensor
    lse: torch.Tensor
    rest_logprob: torch.Tensor
    target_logprob: torch.Tensor

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in vars(self).values())


def next_token_targets(input_ids: torch.Tensor) -> torch.Tensor:
    """Targets for next-token prediction: ``(B, T)`` ids -> ``(B*T,)`` long, ``-1`` at each row's end."""
    targets = torch.full_like(input_ids, -1)
    targets[:, :-1] = input_ids[:, 1:]
    return targets.reshape(-1).cpu()


def worse(a: float, b: float) -> float:
    """``max(a, b)`` that keeps a NaN (Python's ``max`` drops one depending on the order)."""
    return a + b if math.isnan(a) or math.isnan(b) else max(a, b)


def count_nonfinite(t: torch.Tensor) -> int:
    """Number of NaN or infinite elements of ``t``."""
    return int((~torch.isfinite(t)).sum()) if t.is_floating_point() else 0


def _chunk_rows(vocab: int) -> int:
    return max(1, 2**22 // max(vocab, 1))  # 32 MiB per float64 temporary: peak memory stays low


def _target_logprob(logits: torch.Tensor, lse: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    has = targets >= 0
    picked = logits.gather(1, targets.clamp(min=0).unsqueeze(1)).squeeze(1) - lse
    return torch.where(has, picked, torch.full_like(picked, math.nan))


def summarize_logits(logits: torch.Tensor, targets: torch.Tensor, k: int = TOP_K) -> LogitSummary:
    """Summarize ``(N, V)`` logits (any float dtype) with ``(N,)`` next-token targets as a LogitSummary."""
    n, vocab = logits.shape
    k = min(k, vocab)
    parts: list[tuple[torch.Tensor, ...]] = []
    step = _chunk_rows(vocab)
    for s in range(0, n, step):
        a = logits[s : s + step].double()
        lse = torch.logsumexp(a, dim=-1)
        top_logit, top_idx = a.topk(k, dim=-1)
        rest = a.scatter(1, top_idx, -math.inf)
        rest_lp = torch.logsumexp(rest, dim=-1) - lse
        parts.append((top_idx, top_logit, lse, rest_lp, _target_logprob(a, lse, targets[s : s + step])))
    cols = [torch.cat(c) for c in zip(*parts, strict=True)]
    return LogitSummary(*cols)


def logit_metrics(ref: torch.Tensor | LogitSummary, conv: torch.Tensor, targets: torch.Tensor) -> dict:
    """Compare converted logits with reference logits, row by row.

    Args:
        ref: reference (original model) logits ``(N, V)`` or their :class:`LogitSummary`.
        conv: converted model logits ``(N, V)``, any float dtype.
        targets: ``(N,)`` long next-token ids, ``-1`` where a row has no next token.

    Returns:
        dict with ``max_abs``, ``mean_abs``, ``max_rel`` (max over rows of ``max|b-a| / max|a|``),
        ``kl_mean``/``kl_max`` (KL(ref || conv) per row, natural log), ``top1`` (argmax agreement),
        ``flip_margins`` (the reference's top-2 margin at each row whose top-1 changed), ``top5`` (mean
        overlap of the two top-5 sets), ``nll_ref``/``nll_conv`` (summed next-token NLL), ``n_targets``,
        ``rows``,
        ``exact`` (False for a summary reference: then abs/rel differences are over the reference's top-k
        tokens only and KL is over the partition {top-k tokens, the rest}, a lower bound of the true KL
        by the data-processing inequality), ``nonfinite_ref``/``nonfinite_conv`` (NaN or inf elements;
        every other metric then carries a NaN or inf too, never a finite value that hides them).
    """
    full = isinstance(ref, torch.Tensor)
    n, vocab = conv.shape
    acc = dict(max_abs=0.0, sum_abs=0.0, n_abs=0, max_rel=0.0, kl_sum=0.0, kl_max=0.0, top1=0, top5=0.0)
    bad_ref = bad_conv = 0
    nll_ref = nll_conv = 0.0
    n_targets = 0
    flip_margins: list[torch.Tensor] = []
    step = _chunk_rows(vocab)
    for s in range(0, n, step):
        b = conv[s : s + step].double()
        bad_conv += count_nonfinite(b)
        tg = targets[s : s + step]
        lse_b = torch.logsumexp(b, dim=-1)
        if full:
            a = ref[s : s + step].double()
            bad_ref += count_nonfinite(a)
            lse_a = torch.logsumexp(a, dim=-1)
            top_a, idx_a = a.topk(min(5, vocab), dim=-1)
            diff = b - a
            lo, hi = a.aminmax(dim=-1)
            scale = torch.maximum(hi, -lo)
            # KL(a||b) = sum p_a (lp_a - lp_b) = lse_b - lse_a - sum p_a (b - a), one pass over the row
            kl = lse_b - lse_a - torch.linalg.vecdot((a - lse_a[:, None]).exp_(), diff)
            tlp_a = _target_logprob(a, lse_a, tg)
            diff = diff.abs_()
        else:
            idx_a = ref.top_idx[s : s + step]
            top_a = ref.top_logit[s : s + step]
            bad_ref += count_nonfinite(top_a)
            lse_a = ref.lse[s : s + step]
            b_sel = b.gather(1, idx_a)
            diff = (b_sel - top_a).abs()
            scale = top_a.abs().amax(dim=-1)
            lp_a, lp_b = top_a - lse_a[:, None], b_sel - lse_b[:, None]
            rest_a = ref.rest_logprob[s : s + step]
            rest_b = torch.logsumexp(b.scatter(1, idx_a, -math.inf), dim=-1) - lse_b
            has_rest = rest_a > -math.inf
            rest_term = torch.where(has_rest, rest_a.exp() * (rest_a - rest_b), torch.zeros_like(rest_a))
            kl = (lp_a.exp() * (lp_a - lp_b)).sum(-1) + rest_term
            tlp_a = ref.target_logprob[s : s + step]
        row_max = diff.amax(dim=-1)
        acc["max_abs"] = worse(acc["max_abs"], row_max.max().item())
        acc["sum_abs"] += diff.sum().item()
        acc["n_abs"] += diff.numel()
        acc["max_rel"] = worse(acc["max_rel"], (row_max / scale.clamp(min=1e-30)).max().item())
        acc["kl_sum"] += kl.sum().item()
        acc["kl_max"] = worse(acc["kl_max"], kl.max().item())
        idx_b5 = b.topk(min(5, vocab), dim=-1).indices
        same = idx_b5[:, 0] == idx_a[:, 0]
        acc["top1"] += int(same.sum())
        flip_margins.append((top_a[:, 0] - top_a[:, 1])[~same] if top_a.shape[1] > 1 else top_a[:0, 0])
        idx_a5 = idx_a[:, : idx_b5.shape[1]]
        acc["top5"] += (idx_a5[:, :, None] == idx_b5[:, None, :]).any(-1).double().mean(-1).sum().item()
        has = tg >= 0
        nll_ref -= tlp_a[has].sum().item()
        nll_conv -= _target_logprob(b, lse_b, tg)[has].sum().item()
        n_targets += int(has.sum())
    return {
        "max_abs": acc["max_abs"],
        "mean_abs": acc["sum_abs"] / max(acc["n_abs"], 1),
        "max_rel": acc["max_rel"],
        "kl_mean": acc["kl_sum"] / n,
        "kl_max": acc["kl_max"],
        "top1": acc["top1"] / n,
        "flip_margins": torch.cat(flip_margins).tolist(),
        "top5": acc["top5"] / n,
        "nll_ref": nll_ref,
        "nll_conv": nll_conv,
        "n_targets": n_targets,
        "rows": n,
        "exact": full,
        "nonfinite_ref": bad_ref,
        "nonfinite_conv": bad_conv,
    }


def hidden_metrics(ref: torch.Tensor, conv: torch.Tensor) -> dict:
    """Compare ``(N, D)`` hidden states (encoders without logits): max/mean abs, max per-row relative, and
    the NaN/inf counts ``nonfinite_ref``/``nonfinite_conv`` (a NaN propagates into every metric)."""
    diff = (conv.double() - ref.double()).abs()
    row_max = diff.amax(dim=-1)
    scale = ref.double().abs().amax(dim=-1).clamp(min=1e-30)
    return {
        "max_abs": row_max.max().item(),
        "mean_abs": diff.mean().item(),
        "max_rel": (row_max / scale).max().item(),
        "rows": ref.shape[0],
        "exact": True,
        "nonfinite_ref": count_nonfinite(ref),
        "nonfinite_conv": count_nonfinite(conv),
    }


def perplexity(nll_sum: float, count: int) -> float | None:
    """``exp(sum NLL / count)``; ``inf`` where that overflows a float (a mean NLL above about 709.78
    nats), NaN for a NaN NLL, ``None`` when there is no target."""
    if not count:
        return None
    try:
        return math.exp(nll_sum / count)
    except OverflowError:
        return math.inf
