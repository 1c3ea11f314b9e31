"""The options of a conversion as one validated object (``ConvertOptions``); imports no torch.

``normswap convert``'s flags and ``normswap.convert_pretrained``'s keyword arguments are the same options
(``--no-untie`` is ``untie=False``, ``--tokenizer`` is ``tokenizer``); every combination that cannot work is
refused here, in one place, before anything is loaded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from normswap.errors import NormswapError
from normswap.options import DTYPE_CHOICES, parse_size
from normswap.quantize import SCHEMES

NORM_CHOICES = ("keep", "rmsnorm")
ROTATE_KINDS = ("hadamard", "random", "learned")
ROTATE_TARGETS = tuple(name for name, s in SCHEMES.items() if s.library is None)  # rotate.learn.TARGETS
# rotate="learned": the defaults of normswap.rotate.learn.Settings (measured to fit SmolLM2-135M in 20 minutes
# on 2 CPU cores, docs/ROTATION.md), and the options that set them
LEARN_DEFAULTS = {"target": "a4", "steps": 40, "batch": 1, "length": 256, "samples": 64, "lr": 1e-3}
LEARN_OPTIONS = tuple(f"rotate_{name}" for name in LEARN_DEFAULTS) + ("rotate_calibration",)
LEARN_ONLY = "rotate_target=..., rotate_steps=... and the other learning options need rotate='learned'"
LEARNED_VS_STREAM = (
    "rotate='learned' learns Q on a copy of the model in memory: it cannot stream (max_memory=...); "
    "convert in memory (drop max_memory=...), or use rotate='hadamard'"
)
KEEP_VS_CENTER = (
    "norm='rmsnorm' centers the residual stream, which moves every hidden state by its mean: it cannot keep "
    "the hidden states (keep_hidden_states=True); drop one of the two"
)
KEEP_VS_ROTATE = (
    "rotate=... rotates the residual stream, which turns every hidden state h into h Q: it cannot keep the "
    "hidden states (keep_hidden_states=True); drop one of the two"
)
ROTATE_ONLY = "rotate_heads=True and rotate_seed=... need rotate='hadamard'|'random'|'learned'"
DEVICE_MAP_VS_STREAM = "device_map=... is not available when streaming (max_memory=...); give device=..."

# an option's Python wording in a message -> its CLI wording (``cli_wording``)
_API_TO_CLI = {
    "rotate_heads=True": "--rotate-heads",
    "rotate_seed=...": "--rotate-seed",
    "rotate='hadamard'|'random'|'learned'": "--rotate hadamard|random|learned",
    "rotate='learned'": "--rotate learned",
    "rotate='hadamard'": "--rotate hadamard",
    "rotate_target=..., rotate_steps=...": "--rotate-target, --rotate-steps",
    "device_map=...": "--device-map",
    "max_memory=...": "--max-memory",
    "device=...": "--device",
    "overwrite=True": "--overwrite",
    "trust_remote_code=True": "--trust-remote-code",
    "keep_hidden_states=True": "--keep-hidden-states",
    "norm='rmsnorm'": "--norm rmsnorm",
    "rotate=...": "--rotate",
}


def cli_wording(message: str) -> str:
    """A library error's line with its Python arguments (``overwrite=True``) named as CLI options."""
    for api, option in _API_TO_CLI.items():
        message = message.replace(api, option)
    return message


class OptionError(NormswapError, ValueError):
    """Options that cannot go together, or a value out of range (one line; the CLI exits 2).

    ``usage`` is True for a combination of flags that the CLI reports as a usage error (it adds
    ``(see normswap convert --help)``)."""

    def __init__(self, message: str, *, usage: bool = False) -> None:
        super().__init__(message)
        self.usage = usage


@dataclass(frozen=True)
class ConvertOptions:
    """What ``normswap convert`` is asked to do (each field is the CLI option of the same name).

    Attributes:
        norm: ``"keep"`` (each norm keeps its kind) or ``"rmsnorm"`` (LayerNorms centered into RMSNorms).
        dtype: ``"auto"`` (the checkpoint's own; float32 for a GGUF file), ``"float32"``, ``"bfloat16"``
            or ``"float16"``: the precision the model is loaded, converted, checked and saved in.
        device: ``"auto"``, ``"cpu"``, ``"cuda"``, ``"cuda:1"``, ... (``normswap.device.resolve_device``).
        device_map: passed to ``from_pretrained`` instead of ``device`` (in memory only).
        trust_remote_code: allow the model's own Python code to run.
        tokens: tokens of real text the check runs on (at least 2; None: 512 or the model's context).
        tokenizer: tokenizer of the check's text only (hub id or folder); None: the model's own.
        force: save even when the check fails.
        overwrite: replace an output folder that normswap wrote (or an empty one), once the new one is
            verified.
        untie: fold the final norm into a tied ``lm_head`` by giving it its own tensor (``--no-untie``:
            False).
        keep_hidden_states: keep every hidden state the original's (the final norm is not folded).
        rotate: None, ``"hadamard"``, ``"random"`` or ``"learned"``: rotate the residual stream after folding
            (``"learned"``: ``Q`` trained from the randomized Hadamard one for a fake quantizer,
            ``normswap.rotate.learn``; in memory only).
        rotate_seed: seed of the rotation's random draws, 0 to 2**63 - 1.
        rotate_heads: also rotate each attention head's values and output projection.
        rotate_target, rotate_steps, rotate_batch, rotate_length, rotate_samples, rotate_lr: how
            ``"learned"`` learns (``normswap.rotate.learn.Settings``; None: its default).
        rotate_calibration: a UTF-8 text file ``"learned"`` trains on (None: the end of Python's pydoc
            topics, which ``normswap eval`` does not read by default).
        max_memory: hold at most about this many bytes of weights (an int, or a size such as ``"2GiB"``:
            ``normswap.options.parse_size``); a larger safetensors model is streamed.
        no_stream: convert in memory even when the model would not fit.

    Raises:
        OptionError: on construction, for a value out of range or options that cannot go together (with
            the messages the CLI prints, in the API's wording).
    """

    norm: str = "keep"
    dtype: str = "auto"
    device: str = "auto"
    device_map: str | None = None
    trust_remote_code: bool = False
    tokens: int | None = None
    tokenizer: str | None = None
    force: bool = False
    overwrite: bool = False
    untie: bool = True
    keep_hidden_states: bool = False
    rotate: str | None = None
    rotate_seed: int = 0
    rotate_heads: bool = False
    rotate_target: str | None = None
    rotate_steps: int | None = None
    rotate_batch: int | None = None
    rotate_length: int | None = None
    rotate_samples: int | None = None
    rotate_lr: float | None = None
    rotate_calibration: str | None = None
    max_memory: int | str | None = None
    no_stream: bool = False

    def __post_init__(self) -> None:
        _choice("norm", self.norm, NORM_CHOICES)
        _choice("dtype", self.dtype, DTYPE_CHOICES)
        if self.rotate is not None:
            _choice("rotate", self.rotate, ROTATE_KINDS)
        if not isinstance(self.rotate_seed, int) or not 0 <= self.rotate_seed < 2**63:
            raise OptionError(f"rotate_seed must be an integer from 0 to 2**63 - 1, not {self.rotate_seed!r}")
        if self.tokens is not None and (not isinstance(self.tokens, int) or self.tokens < 2):
            raise OptionError(f"tokens must be an integer of at least 2, not {self.tokens!r}")
        if self.max_memory is not None and not isinstance(self.max_memory, int):
            try:
                parse_size(self.max_memory)
            except ValueError as error:
                raise OptionError(f"max_memory {error}") from None
        elif self.max_memory is not None and self.max_memory <= 0:
            raise OptionError(f"max_memory must be positive, not {self.max_memory}")
        if self.rotate is None and (self.rotate_heads or self.rotate_seed != 0):
            raise OptionError(ROTATE_ONLY, usage=True)
        self._learning()
        if self.keep_hidden_states and self.norm == "rmsnorm":
            raise OptionError(KEEP_VS_CENTER)
        if self.keep_hidden_states and self.rotate is not None:
            raise OptionError(KEEP_VS_ROTATE)
        if self.device_map is not None and self.max_memory is not None:
            raise OptionError(DEVICE_MAP_VS_STREAM)

    def _learning(self) -> None:
        """The learning options: only with rotate='learned', each in its range; not streamed."""
        given = [name for name in LEARN_OPTIONS if getattr(self, name) is not None]
        if given and self.rotate != "learned":
            raise OptionError(LEARN_ONLY, usage=True)
        if self.rotate_target is not None:
            _choice("rotate_target", self.rotate_target, ROTATE_TARGETS)
        for name, least in [("rotate_steps", 1), ("rotate_batch", 1), ("rotate_length", 2),
                            ("rotate_samples", 1)]:  # fmt: skip
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < least):
                raise OptionError(f"{name} must be an integer of at least {least}, not {value!r}")
        lr = self.rotate_lr
        if lr is not None and not (isinstance(lr, (int, float)) and math.isfinite(lr) and lr > 0):
            raise OptionError(f"rotate_lr must be a positive number, not {lr!r}")
        if self.rotate_samples is not None and self.rotate_samples < (self.rotate_batch or 1):
            raise OptionError(f"rotate_samples ({self.rotate_samples}) must be at least rotate_batch "
                              f"({self.rotate_batch})")  # fmt: skip
        if self.rotate == "learned" and self.max_memory is not None:
            raise OptionError(LEARNED_VS_STREAM)

    def learn_settings(self) -> dict:
        """The learning options given (not None), as ``normswap.rotate.learn.Settings``' keyword arguments."""
        return {name.removeprefix("rotate_"): getattr(self, name) for name in LEARN_OPTIONS[:-1]
                if getattr(self, name) is not None}  # fmt: skip

    @classmethod
    def of(cls, options: dict) -> ConvertOptions:
        """``ConvertOptions(**options)``; an unknown name is an ``OptionError`` listing the known ones."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise OptionError(f"unknown option {unknown[0]!r}; the options are {', '.join(sorted(known))}")
        return cls(**options)


def _choice(name: str, value, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise OptionError(f"{name} must be one of {', '.join(map(repr, choices))}, not {value!r}")
