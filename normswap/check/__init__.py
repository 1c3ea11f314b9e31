"""Is the converted model the same model? Metrics, tolerance policy per dtype, divergence localization.

Public API: :func:`check` (both models in memory), :func:`reference_outputs` + :func:`compare` (lean:
reference first, convert in place, then compare), :func:`default_input_ids` (:func:`vocabulary_ids` for a
model without a tokenizer), :class:`CheckResult`. See docs/CHECKING.md.
"""

from .core import CheckResult, Reference, check, compare, peak_rss_mib, reference_outputs, upcast
from .policy import DEFAULT_TOLERANCE, default_tolerance
from .text import VOCABULARY_SEED, default_input_ids, default_text, vocabulary_ids

__all__ = [
    "VOCABULARY_SEED",
    "DEFAULT_TOLERANCE",
    "CheckResult",
    "Reference",
    "check",
    "compare",
    "default_input_ids",
    "default_text",
    "default_tolerance",
    "peak_rss_mib",
    "reference_outputs",
    "upcast",
    "vocabulary_ids",
]
