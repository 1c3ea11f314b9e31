"""Quantization schemes for ``normswap eval --quantize``: what a quantizer does to a converted model.

A conversion changes the weights and the activations that a quantizer sees (folding moves each norm's
scale into its readers' input columns; a rotation spreads the stream's outliers), so the same quantizer
treats the original and the converted model differently. ``normswap eval --quantize SCHEME`` runs both
models under one of the schemes here. normswap's own schemes need no quantization library and run in
torch on whatever device the model is on; four more run through llm-compressor when it is installed.

Which ops are quantized comes from the forward itself (a ``TorchFunctionMode``), not from module names or
types: a **linear op** is an op that multiplies a runtime tensor by one of the model's 2-D parameters along
the tensor's last axis -- ``F.linear(x, W, b)`` (``W``: out x in, ``nn.Linear`` and anything calling
``F.linear``), and ``x @ W``, ``torch.matmul(x, W)``, ``torch.mm(x, W)``, ``torch.addmm(b, x, W)`` (``W``:
in x out, transformers' ``Conv1D``), also with ``W.t()``/``W.T``/``W.mT``/``W.transpose(0, 1)`` in place of
``W``. The output head (``model.get_output_embeddings()``, ``lm_head``) is left out, as quantizers commonly
leave it in higher precision; so are embedding lookups (not linear ops) and stacked 3-D expert weights
(``bmm``/``grouped_mm`` of MoE layers: not 2-D parameters). The scheme table here imports no torch;
``normswap.quantize.fake`` holds the fake quantization.

normswap's own schemes (:data:`SCHEMES` with ``library`` None), symmetric round-to-nearest with
``L = 2^(b-1) - 1`` levels on each side (``2^b - 1`` values, ``-L .. L`` times the scale), scale =
``max |x| / L`` over each slice:

* ``a8``, ``a6``, ``a4``: the input of every linear op, per token (one scale per row of the last axis);
* ``w4``: the weight of every linear op, per output channel (one scale per output feature);
* ``w4a4``: both (``a4`` and ``w4``), the target ``--rotate learned`` trains for by default.

With llm-compressor installed (the ``quant`` extra, in an environment of its own: it pins transformers),
``w8a8`` (8-bit weights per channel, 8-bit dynamic per-token activations), ``w4a16`` (4-bit weights in groups
of 64, round-to-nearest), ``w4a16-gptq`` and ``w4a8-gptq`` (GPTQ, calibrated on text) run through its
``oneshot`` on a copy of each model (``normswap.quantize.llmc``).

The model is never modified: activations are quantized as they flow, and a weight scheme uses a quantized
copy of each linear weight, made on first use and held while the context is open (about the linear
weights once more in memory).
"""

from __future__ import annotations

from dataclasses import dataclass

from normswap.errors import NormswapError


@dataclass(frozen=True)
class Scheme:
    """One quantization scheme: ``activation_bits`` (per token) and/or ``weight_bits`` (per output channel, or
    per ``group_size`` inputs of it), ``None`` where that side stays in the model's precision; ``library``
    ``None`` for normswap's own round-to-nearest fake quantization, ``"llmcompressor"`` for a scheme run
    through llm-compressor (``method`` ``"rtn"`` or ``"gptq"``, ``normswap.quantize.llmc``)."""

    name: str
    activation_bits: int | None = None
    weight_bits: int | None = None
    group_size: int | None = None
    library: str | None = None
    method: str = "rtn"

    @property
    def description(self) -> str:
        parts = []
        if self.weight_bits:
            per = f"per group of {self.group_size} inputs" if self.group_size else "per output channel"
            parts.append(f"{self.weight_bits}-bit weights {per}")
        if self.activation_bits:
            parts.append(f"{self.activation_bits}-bit activations per token")
        how = "GPTQ" if self.method == "gptq" else "round-to-nearest"
        where = f"llm-compressor {how}" if self.library else how
        return " and ".join(parts) + f", {where}, at every linear op but lm_head"


SCHEMES: dict[str, Scheme] = {
    "a8": Scheme("a8", activation_bits=8),
    "a6": Scheme("a6", activation_bits=6),
    "a4": Scheme("a4", activation_bits=4),
    "w4": Scheme("w4", weight_bits=4),
    "w4a4": Scheme("w4a4", activation_bits=4, weight_bits=4),
    "w8a8": Scheme("w8a8", activation_bits=8, weight_bits=8, library="llmcompressor"),
    "w4a16": Scheme("w4a16", weight_bits=4, group_size=64, library="llmcompressor"),
    "w4a16-gptq": Scheme("w4a16-gptq", weight_bits=4, group_size=64, library="llmcompressor", method="gptq"),
    "w4a8-gptq": Scheme(
        "w4a8-gptq", activation_bits=8, weight_bits=4, group_size=64, library="llmcompressor", method="gptq"
    ),  # fmt: skip
}


def get_scheme(name: str) -> Scheme:
    """The :class:`Scheme` called ``name``.

    Raises:
        NormswapError: no such scheme (the message lists the known ones).
    """
    try:
        return SCHEMES[name]
    except KeyError:
        raise NormswapError(f"unknown quantization scheme {name!r}; known: {', '.join(SCHEMES)}") from None


def __getattr__(name: str):
    """``rtn``, ``FakeQuant`` and ``quantized`` load torch on first use (``normswap.quantize.fake``)."""
    if name in ("rtn", "FakeQuant", "quantized"):
        from normswap.quantize import fake as module

        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
