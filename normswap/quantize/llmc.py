"""The llm-compressor schemes of ``eval --quantize`` (``w8a8``, ``w4a16``, ``w4a16-gptq``, ``w4a8-gptq``).

Each model is deep-copied and the copy quantized by llm-compressor's ``oneshot`` with a
``QuantizationModifier`` (round-to-nearest) or a ``GPTQModifier`` recipe: symmetric int weights (per output
channel, or in groups of ``scheme.group_size`` inputs), and for ``w8a8``/``w4a8-gptq`` dynamic per-token int8
activations, at every ``Linear`` but the output head (found as ``model.get_output_embeddings()``, ignored
by its module name). The copy runs its quantization in its forward (compressed-tensors' fake quantization),
so it is evaluated as it is; the model given is not changed. GPTQ calibrates on ``calibration`` (token
windows the caller chooses: ``normswap eval`` takes them from a text that is not the evaluation text). A
model loaded from a quantized file into float weights (a GGUF file) is quantized from those float weights
(llm-compressor refuses a config that records another quantization format, so the copy's record is
dropped).

On a CPU, GPTQ's solve (per weight column, a few operations on small tensors) runs on one torch thread:
more threads only wait on each other there, and on a busy machine each operation waits for a time slice
(about 10x slower on 2 shared cores, docs/ROTATION.md); the calibration forwards keep torch's threads.

llm-compressor is an optional dependency (``pip install -e '.[quant]'``); it pins its own transformers
range, so install it in an environment of its own.
"""

from __future__ import annotations

import contextlib
import copy
import io
import tempfile

import torch
from torch import nn

from normswap.errors import NormswapError
from normswap.quantize import Scheme

INSTALL = (
    "pip install -e '.[quant]' in normswap's checkout, in a virtual environment of its own (llm-compressor "
    "pins its transformers versions)"
)


def require() -> None:
    """Raises NormswapError (naming the install command) when llm-compressor cannot be imported."""
    try:
        import llmcompressor  # noqa: F401
    except ImportError as error:
        raise NormswapError(f"the llm-compressor schemes need llm-compressor ({error}): {INSTALL}") from None


def recipe(scheme: Scheme, ignore: list[str]):
    """The llm-compressor modifier for ``scheme``, targeting every ``Linear`` but the names in ``ignore``."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier

    weights = QuantizationArgs(
        num_bits=scheme.weight_bits,
        type="int",
        symmetric=True,
        strategy="group" if scheme.group_size else "channel",
        group_size=scheme.group_size,
        dynamic=False,
    )
    activations = None
    if scheme.activation_bits:
        activations = QuantizationArgs(
            num_bits=scheme.activation_bits, type="int", symmetric=True, strategy="token", dynamic=True
        )
    config = QuantizationScheme(targets=["Linear"], weights=weights, input_activations=activations)
    if scheme.method != "gptq":
        return QuantizationModifier(config_groups={"group_0": config}, ignore=ignore)

    class CpuGPTQModifier(GPTQModifier):
        """GPTQ whose solve runs on one torch thread when the weights are on the CPU (its column loop is many
        small operations, whose threads only wait on each other there); the same numbers."""

        def compress_modules(self):
            on_cpu = all(m.weight.device.type == "cpu" for m in self._num_samples)
            with one_thread() if on_cpu else contextlib.nullcontext():
                return super().compress_modules()

    return CpuGPTQModifier(config_groups={"group_0": config}, ignore=ignore)


@contextlib.contextmanager
def one_thread():
    """torch's intra-op threads set to one inside, restored after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def quantize_copy(
    model: nn.Module, scheme: Scheme, calibration: list[torch.Tensor], tokenizer, *, quiet: bool = True
) -> nn.Module:
    """A deep copy of ``model`` quantized by llm-compressor's ``oneshot`` with ``scheme``.

    Args:
        model: a causal LM (``nn.Module`` with ``config`` and ``get_output_embeddings``).
        scheme: a :class:`Scheme` with ``library == "llmcompressor"``.
        calibration: ``(1, L)`` long tensors of token ids (GPTQ's calibration samples, taken in this order:
            a model quantized twice gets the same weights; unused by RTN, which needs none).
        tokenizer: the models' tokenizer (``oneshot`` requires a processor with a dataset).
        quiet: silence llm-compressor's log (which it writes to stdout) and progress bars; else its bars
            show on stderr and its log stays off stdout all the same (a script reads results there).

    Returns:
        the quantized copy, in eval mode; its forward applies the quantization.

    Raises:
        NormswapError: llm-compressor is missing, or its ``oneshot`` fails (its message quoted).
    """
    require()
    import datasets
    from llmcompressor import oneshot
    from loguru import logger

    for library in ("llmcompressor", "compressed_tensors"):
        logger.disable(library)

    head = model.get_output_embeddings()
    ignore = [name for name, module in model.named_modules() if module is head and head is not None]
    quantized = copy.deepcopy(model)
    rows = [ids.reshape(-1).tolist() for ids in calibration]
    data = datasets.Dataset.from_dict({"input_ids": rows, "attention_mask": [[1] * len(r) for r in rows]})
    with tempfile.TemporaryDirectory() as folder:
        # oneshot reads the model's config back from config.name_or_path: give it the copy's own, without
        # the record of a quantized source whose weights are float now (a GGUF file, dequantized on load)
        config = copy.deepcopy(quantized.config)
        floating = all(p.is_floating_point() for p in quantized.parameters())
        if floating and hasattr(config, "quantization_config"):
            del config.quantization_config
        config.save_pretrained(folder)
        quantized.config._name_or_path = folder
        try:
            with contextlib.redirect_stderr(io.StringIO()) if quiet else contextlib.nullcontext():
                oneshot(
                    model=quantized,
                    dataset=data,
                    recipe=recipe(scheme, ignore),
                    processor=tokenizer,
                    num_calibration_samples=len(rows),
                    max_seq_length=max(len(r) for r in rows),
                    # in the order given: shuffled (oneshot's default, by torch's global generator), the
                    # Hessians' float sums change from run to run, and GPTQ's roundings with them (the
                    # same model quantized twice gave perplexity 21.5 and 21.8)
                    shuffle_calibration_samples=False,
                )
        except Exception as error:
            raise NormswapError(f"llm-compressor could not quantize with {scheme.name}: {error}") from error
    return quantized.eval()


def quantized_ops(model: nn.Module) -> int:
    """How many modules of ``model`` llm-compressor quantizes (they carry a ``quantization_scheme``)."""
    return sum(1 for m in model.modules() if getattr(m, "quantization_scheme", None) is not None)
