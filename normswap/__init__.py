"""normswap: find, fold and fuse the normalization layers of pretrained language models.

Public API::

    sites = normswap.inspect(model)                 # list[NormSite], changes nothing
    report = normswap.convert(model)                # in place: fold + swap; ConvertReport
    result = normswap.check(original, converted, input_ids)   # CheckResult
    model = normswap.load_pretrained(path)          # a saved conversion, fused modules in place
"""

from normswap.center import CenteringError
from normswap.convert import ConvertReport, convert, inspect
from normswap.errors import NormswapError
from normswap.sites import Consumer, NormSite

__all__ = [
    "CenteringError",
    "Consumer",
    "ConvertReport",
    "NormSite",
    "NormswapError",
    "check",
    "convert",
    "inspect",
    "load_pretrained",
]
__version__ = "0.1.0"


# Imported last so that ``normswap.check`` names the function, not the ``normswap.check`` package.
from normswap.check import check  # noqa: E402


def __getattr__(name: str):
    # io pulls in more of transformers; import it on first use.
    if name == "load_pretrained":
        from normswap.io import load_pretrained

        return load_pretrained
    raise AttributeError(f"module 'normswap' has no attribute {name!r}")
