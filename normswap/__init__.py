"""normswap: find, fold and fuse the normalization layers of pretrained language models.

Public API::

    result = normswap.convert_pretrained("smollm2-135m", "out", rotate="hadamard")  # = normswap convert
    sites = normswap.inspect(model)                 # list[NormSite], changes nothing
    report = normswap.convert(model)                # in place: fold + swap; ConvertReport
    result = normswap.check(original, converted, input_ids)   # CheckResult
    model = normswap.load_pretrained(path)          # a saved conversion, fused modules in place

The names are imported on first use (PEP 562), so ``import normswap`` (and the CLI's ``--help``,
``--version`` and usage errors) does not import torch or transformers.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types

__version__ = "0.1.0"

# public name -> module that defines it
_LAZY = {
    "CenteringError": "normswap.center",
    "Consumer": "normswap.sites",
    "ConvertOptions": "normswap.config",
    "ConvertReport": "normswap.convert",
    "ConvertResult": "normswap.pipeline",
    "NormSite": "normswap.sites",
    "NormswapError": "normswap.errors",
    "OptionError": "normswap.config",
    "RotationError": "normswap.rotate",
    "check": "normswap.check",
    "convert": "normswap.convert",
    "convert_pretrained": "normswap.pipeline",
    "inspect": "normswap.convert",
    "load_pretrained": "normswap.io",
}
__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        if not isinstance(value, types.ModuleType):
            globals()[name] = value
        return value
    if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f"{__name__}.{name}")  # a subpackage on first use: normswap.io
    raise AttributeError(f"module 'normswap' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


class _Package(types.ModuleType):
    """Keeps ``normswap.check`` and ``normswap.convert`` naming the functions, not the subpackages.

    Importing a submodule sets it as an attribute of its package; for these two names the function wins.
    """

    def __setattr__(self, name: str, value) -> None:
        if name in ("check", "convert") and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
