"""Is the converted model the same model? Metrics, tolerance policy per dtype, divergence localization.

Public API: :func:`check` (both models in memory), :func:`reference_outputs` + :func:`compare` (lean:
reference first, convert in place, then compare), :func:`default_input_ids` (:func:`vocabulary_ids` for a
model without a tokenizer), :class:`CheckResult`; for float32's second rule (the float64 reference, where
the fixed bound misses) :func:`reload_original` / :func:`keep_original` give ``reference_outputs(rerun=)``,
:class:`NoFloat64Reference` says why it could not run.
See docs/CHECKING.md. The names are imported on first use, so that the CLI's ``check`` command (in
``command.py``) registers without importing torch.
"""

from __future__ import annotations

import importlib

_LAZY = {
    "CheckResult": ".core",
    "NoFloat64Reference": ".core",
    "FLOAT64_RULE": ".policy",
    "float64_metrics": ".core",
    "keep_original": ".core",
    "reload_original": ".core",
    "Reference": ".core",
    "check": ".core",
    "compare": ".core",
    "peak_rss_mib": ".core",
    "reference_outputs": ".core",
    "upcast": ".core",
    "DEFAULT_TOLERANCE": ".policy",
    "default_tolerance": ".policy",
    "default_input_ids": ".text",
    "default_text": ".text",
    "VOCABULARY_SEED": ".text",
    "vocabulary_ids": ".text",
}
__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'normswap.check' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
