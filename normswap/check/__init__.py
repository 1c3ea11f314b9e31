"""Is the converted model the same model? Metrics, tolerance policy per dtype, divergence localization.

Public API: :func:`check` (both models in memory), :func:`reference_outputs` + :func:`compare` (lean:
reference first, convert in place, then compare), :func:`default_input_ids` (:func:`vocabulary_ids` for a
model without a tokenizer), :class:`CheckResult`.
See docs/CHECKING.md. The names are imported on first use, so that the CLI's ``check`` command (in
``command.py``) registers without importing torch.
"""

from __future__ import annotations

import importlib

_LAZY = {
    "CheckResult": ".core",
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
