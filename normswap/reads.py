"""Which attributes of a model's config objects a forward reads.

Untying a tied ``lm_head`` flips ``tie_word_embeddings`` on the model's config objects (``tie_configs``). A
forward that never reads that flag computes the same function whatever its value, so the walk records the
names its one traced forward reads (``read_names``) and the untie proof (``normswap.fold.untie_checked``)
runs its two comparison forwards only for a model that read the flag, or read a config's state wholesale
(any dunder name: ``__dict__``, ``__getstate__``, ...).

Reads are seen by wrapping ``__getattribute__`` of each config object's class for the duration of the
block (restored after, also on error); only reads on the watched objects are recorded. A name that the
class's ``attribute_map`` redirects is recorded as the name it reads.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn

TIE_FLAG = "tie_word_embeddings"


def tie_configs(model: nn.Module) -> list[object]:
    """The config objects whose ``tie_word_embeddings`` untying sets: ``model.config`` and its text config
    (``get_text_config()``), each once; [] for a model without a config."""
    config = getattr(model, "config", None)
    if config is None:
        return []
    configs = {id(config): config}
    if hasattr(config, "get_text_config"):
        text = config.get_text_config()
        configs[id(text)] = text
    return list(configs.values())


def may_read_flag(names: frozenset[str] | None, flag: str = TIE_FLAG) -> bool:
    """Whether a forward that read ``names`` (``read_names``; None: not recorded) may have read ``flag``:
    it read ``flag`` itself or a dunder name, through which a config's whole state can be read."""
    return names is None or flag in names or any(n.startswith("__") for n in names)


@contextlib.contextmanager
def read_names(configs: list[object]) -> Iterator[set[str]]:
    """Record, inside the block, the attribute names read on any of ``configs``; yields the set filled in.

    Each config's class gets a ``__getattribute__`` that records the name (mapped through its
    ``attribute_map``) when the object is one of ``configs``, then reads as before; the classes are
    restored on exit, innermost last-in first-out, so nested blocks and other instances are unaffected.
    """
    watched = {id(c) for c in configs}
    names: set[str] = set()
    patched: list[tuple[type, object | None]] = []
    try:
        for cls in dict.fromkeys(type(c) for c in configs):
            original = cls.__getattribute__
            patched.append((cls, cls.__dict__.get("__getattribute__")))

            def recording(self, key, _original=original, _cls=cls):
                if id(self) in watched:
                    mapped = _cls.__dict__.get("attribute_map") or getattr(_cls, "attribute_map", None) or {}
                    names.add(mapped.get(key, key) if isinstance(mapped, dict) else key)
                return _original(self, key)

            cls.__getattribute__ = recording
        yield names
    finally:
        for cls, own in reversed(patched):
            if own is None:
                del cls.__getattribute__
            else:
                cls.__getattribute__ = own
