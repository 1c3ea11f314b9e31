"""Is the converted model the same model? Metrics, tolerance policy per dtype, divergence localization.

Public API: :func:`check` (both models in memory), :func:`reference_outputs` + :func:`compare` (lean:
reference first, convert in place, then compare), :func:`default_input_ids`, :class:`CheckResult`.
See docs/CHECKING.md.
"""

from .core import CheckResult, Reference, check, compare, peak_rss_mib, reference_outputs, upcast
from .policy import DEFAULT_TOLERANCE, default_tolerance
from .text import default_input_ids, default_text

__all__ = [
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
]
