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

    float32, second rule (``FLOAT64_RULE``), only where the fixed bound misses and no tolerance was given:
    an exact conversion that reorders float32 arithmetic (a rotation above all) can move logits past 2e-4
    on a long input (SmolLM2-135M rotated, 1024 tokens: 2.6e-4), and a top-1 can flip between near-tied
    logits. The original is then run once more with its parameters upcast to float64 (it is re-obtained:
    reloaded from its source, rebuilt over its shards, a kept copy), and both models are judged against
    that float64 reference: with ``e(M) = max |logits(M) - ref64|`` and ``kl(M) = mean KL(ref64 || M)``,
    pass when ``e(converted) <= 2 * e(original) + 5e-5`` and ``kl(converted) <= 2 * kl(original) + 1e-10``
    (no top-1 requirement): the converted model is no further from the exact answer than a small multiple
    of the original's own float32 rounding error. An explicit ``max_abs`` or ``top1`` makes the fixed
    bound final. Measurements behind the constants: docs/CHECKING.md.

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
# float32's second rule, against the float64-upcast original (module docstring)
FLOAT64_RULE: dict[str, float] = {"k": 2.0, "abs": 5e-5, "kl_abs": 1e-10}
FIXED = "fixed bound"
FLOAT64 = "float64 reference"
FLOAT32 = "float32 reference"  # half precision's rule
EXPLICIT_KEYS = ("max_abs", "top1")  # given by the caller, they make float32's fixed bound final


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
    return failures + against_reference(half["original"], half["converted"], tol, "float32")


def against_reference(orig: dict, conv: dict, rule: dict, name: str) -> list[str]:
    """Failed criteria of "no further from a higher-precision reference than ``k`` x the original".

    Args:
        orig, conv: the original's and the converted model's metrics against the reference
            (``logit_metrics``/``hidden_metrics``; ``kl_mean`` where the outputs are logits).
        rule: ``{"k", "abs", "kl_abs"}``: pass when ``e(conv) <= k * e(orig) + abs`` and
            ``kl(conv) <= k * kl(orig) + kl_abs`` (``e``: max abs difference, ``kl``: mean KL(ref || M)).
        name: the reference's dtype, for the message (``"float32"``, ``"float64"``).
    """
    failures = []
    bound = rule["k"] * orig["max_abs"] + rule["abs"]
    if not conv["max_abs"] <= bound:
        failures.append(
            f"max abs error vs the {name} reference {conv['max_abs']:.3g} > {rule['k']:g} x "
            f"{orig['max_abs']:.3g} (original's own) + {rule['abs']:g}"
        )
    if "kl_mean" in conv:
        kl_bound = rule["k"] * orig["kl_mean"] + rule["kl_abs"]
        if not conv["kl_mean"] <= kl_bound:
            failures.append(
                f"mean KL vs the {name} reference {conv['kl_mean']:.3g} > {rule['k']:g} x "
                f"{orig['kl_mean']:.3g} (original's own) + {rule['kl_abs']:g}"
            )
    return failures


def float64_summary(orig: dict, conv: dict, rule: dict = FLOAT64_RULE) -> dict:
    """The report's ``float64_reference`` numbers: ``e_orig``, ``e_conv``, ``kl_orig``, ``kl_conv``
    (``None`` for hidden states), ``bound`` (``k * e_orig + abs``), ``kl_bound``, the rule's constants."""
    kl_orig, kl_conv = orig.get("kl_mean"), conv.get("kl_mean")
    return {
        "e_orig": orig["max_abs"],
        "e_conv": conv["max_abs"],
        "kl_orig": kl_orig,
        "kl_conv": kl_conv,
        "bound": rule["k"] * orig["max_abs"] + rule["abs"],
        "kl_bound": None if kl_orig is None else rule["k"] * kl_orig + rule["kl_abs"],
        **{f"rule_{key}": value for key, value in rule.items()},
    }


def fixed_bound_text(tol: dict, output_name: str = "logit") -> str:
    """``{"max_abs": 2e-4, "top1": 1.0}`` -> ``"max |logit diff| <= 0.0002, top-1 >= 100%"``; half
    precision's rule in words for a half-precision tolerance."""
    parts = []
    if "k" in tol:
        parts.append(f"error vs float32 <= {tol['k']:g} x the original's + {tol.get('abs', 0):g}")
        if "kl_abs" in tol and output_name == "logit":
            parts.append(f"KL vs float32 <= {tol['k']:g} x the original's + {tol['kl_abs']:g}")
        return ", ".join(parts)
    if "max_abs" in tol:
        parts.append(f"max |{output_name} diff| <= {tol['max_abs']:g}")
    if tol.get("top1") and output_name == "logit":
        parts.append(f"top-1 >= {tol['top1']:.0%}")
    return ", ".join(parts)


def float64_text(f64: dict, localized: str | None = None) -> str:
    """``float64_reference`` numbers in words: ``"error vs float64 0.00013 <= 2 x 0.00021 (the original's) +
    5e-05 = 0.00046, KL vs float64 1.1e-11 <= 2 x 1.1e-11 + 1e-10 = 1.2e-10"`` (``>`` where a bound is
    exceeded), and ``localized``, the point the localization found where the bounds held."""

    def op(value, bound) -> str:
        return "<=" if value <= bound else ">"

    text = (
        f"error vs float64 {f64['e_conv']:.2g} {op(f64['e_conv'], f64['bound'])} {f64['rule_k']:g} x "
        f"{f64['e_orig']:.2g} (the original's) + {f64['rule_abs']:g} = {f64['bound']:.2g}"
    )
    if f64.get("kl_conv") is not None:
        text += (
            f", KL vs float64 {f64['kl_conv']:.2g} {op(f64['kl_conv'], f64['kl_bound'])} {f64['rule_k']:g} x "
            f"{f64['kl_orig']:.2g} + {f64['rule_kl_abs']:g} = {f64['kl_bound']:.2g}"
        )
    if localized:
        text += f", but {localized} differs beyond rounding"
    return text


def verdict_line(check: dict) -> str:
    """The verdict of a ``CheckResult.to_dict()`` in one line, as ``convert`` and ``check`` print it:
    ``"PASSED by the fixed bound: max |logit diff| <= 0.0002, top-1 >= 100%"``, ``"PASSED by the float64
    reference: error vs float64 ... (the fixed bound missed: max abs difference 0.00026 > 0.0002)"``,
    ``"PASSED by the float32 reference: ..."`` (half precision), ``"FAILED by the localization: ..."``
    (float32: the logits held their bound, a record did not) or ``"FAILED ..."`` with the numbers of
    every rule tried (the failed criteria are listed on their own lines)."""
    output_name = {"logits": "logit", "last_hidden_state": "hidden state"}.get(check.get("output"), "logit")
    rule = check.get("rule") or FIXED
    f64 = check.get("float64_reference") or {}
    fixed = fixed_bound_text(check.get("tolerance") or {}, output_name)
    if check.get("passed"):
        if rule == FLOAT64:
            missed = "; ".join(f64.get("fixed_bound_missed") or [])
            return f"PASSED by the {FLOAT64}: {float64_text(f64)}" + (
                f" (the fixed bound missed: {missed})" if missed else ""
            )
        return f"PASSED by the {rule}" + (f": {fixed}" if fixed else "")
    if rule == FIXED and check.get("localized"):
        point = check["localized"]
        return f"FAILED by the localization: {point} differs beyond rounding (the {FIXED} held: {fixed})"
    tried = f"{rule}: {fixed}"
    if rule == FLOAT64:
        tried = f"{FIXED}: {fixed}; {FLOAT64}: {float64_text(f64, check.get('localized'))}"
    if f64.get("unavailable"):
        tried += f"; no {FLOAT64}: {f64['unavailable']}"
    return f"FAILED ({tried})"
