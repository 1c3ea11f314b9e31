"""The refusal: ``CenteringError`` and the one-line message every refusal uses."""

from __future__ import annotations

from normswap.errors import NormswapError

WITHOUT_CENTERING = "drop norm='rmsnorm': without it the norms are still folded (where exact) and swapped"


class CenteringError(NormswapError):
    """``norm="rmsnorm"`` asked of a model that cannot be converted exactly; names the site and why.

    Raised before anything is changed: the model is left bit-identical.
    """


def refusal(site: str, what: str) -> CenteringError:
    """The error for LayerNorm ``site`` (module name) that cannot become an RMSNorm because of ``what``.

    The message ends with the fix (``WITHOUT_CENTERING``). The error keeps ``site`` and ``what`` as
    attributes, so a caller that walks the same dataflow for
    another purpose (``normswap.rotate``) can word the refusal its own way.
    """
    error = CenteringError(f"cannot convert LayerNorm {site} to RMSNorm exactly: {what}; {WITHOUT_CENTERING}")
    error.site, error.what = site, what
    return error
