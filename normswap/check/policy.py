"""Tolerance policy per dtype: when a converted model counts as the same model.

float64 / float32 (judged directly against the original):
    pass when ``max_abs <= max_abs_tol`` and the margin-aware top-1 agreement is at least ``top1``:
    a top-1 flip counts as agreement only where the original's top-2 margin is below ``2 * max_abs_tol``
    (a near-tie that logits within the bound may reorder). float32: 2e-4 and 100%; a correct float32
    fold of SmolLM2-135M moves logits by ~6e-5 over 512 tokens, every wrong fold seen moved them >= 4e-3.
    Note that a flip needs ``max_abs >= margin / 2``, so measured against the *observed* max abs every
    flip would be "within the bound": the allowance uses the tolerance instead, and the raw agreement
    and the largest flipped margin are reported next to it.
    float64: 1e-8. The fused norms reproduce float64 modules exactly, also HF's that normalize float64 in
    float32 (measured 0 swap-only, 0 to 3.9e-16 with folds on tiny models); norms that multiply by their
    weight in float32 are not folded in float64 models (that fold moves logits by ~3e-8). docs/CHECKING.md.

bfloat16 / float16 (judged against an upcast reference): the original model is run once more with its
    parameters upcast to float32 (exact for half-precision values). With ``e(M) = max |logits(M) - ref32|``
    and ``kl(M) = mean KL(ref32 || M)``, pass when
    ``e(converted) <= k * e(original) + abs`` and ``kl(converted) <= k * kl(original) + kl_abs``,
    i.e. the conversion may cost at most ``k`` times the rounding error the original already has at that
    precision. See docs/CHECKING.md for the measurements behind ``k`` and the absolute terms.
"""

from __future__ import annotations

import torch

HALF = ("bfloat16", "float16")

DEFAULT_TOLERANCE: dict[str, dict[str, float]] = {
    "float64": {"max_abs": 1e-8, "top1": 1.0, "localize_rtol": 1e-10},
    "float32": {"max_abs": 2e-4, "top1": 1.0, "localize_rtol": 1e-5},
    "bfloat16": {"k": 2.0, "abs": 0.05, "kl_abs": 1e-4, "localize_rtol": 1e-2},
    "float16": {"k": 2.0, "abs": 0.01, "kl_abs": 1e-5, "localize_rtol": 1e-3},
}


def dtype_name(dtype: torch.dtype | str) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")


def default_tolerance(dtype: torch.dtype | str) -> dict[str, float]:
    """Default tolerance dict for a model dtype (see the module docstring).

    Raises:
        ValueError: for a dtype the policy does not cover (integer or 8-bit float models).
    """
    name = dtype_name(dtype)
    if name not in DEFAULT_TOLERANCE:
        raise ValueError(f"no tolerance policy for dtype {name}; pass tolerance=... explicitly")
    return dict(DEFAULT_TOLERANCE[name])


def top1_within_margin(metrics: dict, tol: dict) -> float:
    """Top-1 agreement counting flips at near-ties (top-2 margin < ``2 * tol["max_abs"]``) as agreement."""
    allowed = sum(m < 2 * tol.get("max_abs", 0.0) for m in metrics["flip_margins"])
    return metrics["top1"] + allowed / metrics["rows"]


def judge(metrics: dict, tol: dict, half: dict | None) -> list[str]:
    """Failed criteria as readable strings (empty list: pass). A NaN or infinite output always fails.

    Args:
        metrics: converted vs original at native precision (``logit_metrics``/``hidden_metrics`` output).
        tol: a tolerance dict (``default_tolerance`` with the caller's overrides).
        half: for half precision, ``{"original": metrics, "converted": metrics}`` against the float32
            reference; ``None`` for float32/float64.
    """
    failures = []
    if metrics.get("nonfinite_ref"):
        failures.append(f"the original's outputs hold {metrics['nonfinite_ref']} NaN or infinite values")
    if metrics.get("nonfinite_conv"):
        failures.append(f"the converted outputs hold {metrics['nonfinite_conv']} NaN or infinite values")
    # every comparison is written as "not (value <= bound)": a NaN fails it
    if half is None:
        if not metrics["max_abs"] <= tol["max_abs"]:
            failures.append(f"max abs difference {metrics['max_abs']:.3g} > {tol['max_abs']:.3g}")
        top1 = top1_within_margin(metrics, tol) if "top1" in metrics else 1.0
        if not top1 >= tol.get("top1", 0.0):
            failures.append(f"top-1 agreement {top1:.4%} (near-ties allowed) < {tol['top1']:.4%}")
        return failures
    orig, conv = half["original"], half["converted"]
    bound = tol["k"] * orig["max_abs"] + tol["abs"]
    if not conv["max_abs"] <= bound:
        failures.append(
            f"max abs error vs the float32 reference {conv['max_abs']:.3g} > {tol['k']:g} x "
            f"{orig['max_abs']:.3g} (original's own) + {tol['abs']:g}"
        )
    if "kl_mean" in conv:
        kl_bound = tol["k"] * orig["kl_mean"] + tol["kl_abs"]
        if not conv["kl_mean"] <= kl_bound:
            failures.append(
                f"mean KL vs the float32 reference {conv['kl_mean']:.3g} > {tol['k']:g} x "
                f"{orig['kl_mean']:.3g} (original's own) + {tol['kl_abs']:g}"
            )
    return failures
