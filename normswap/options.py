"""click options shared by several commands; importing this module imports no torch (fast ``--help``)."""

from __future__ import annotations

import click


def device_option(f):
    """The ``--device`` option of convert, inspect, check, eval and zoo (see ``device.resolve_device``)."""
    return click.option(
        "--device",
        default="auto",
        show_default=True,
        help="Where the model runs: auto (the first CUDA GPU if any, else the CPU), cpu, cuda or cuda:N. "
        "Ignored with --device-map.",
    )(f)


DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")


def dtype_option(f=None, *, help="Precision the models are loaded and compared in."):  # noqa: A002
    """The ``--dtype`` option of check and eval: ``auto`` (default) is the first model's own checkpoint dtype
    (``normswap.io.load.resolve_dtype``: float32 for a GGUF file), used for both models."""
    if f is None:
        return lambda g: dtype_option(g, help=help)
    return click.option(
        "--dtype",
        type=click.Choice(DTYPE_CHOICES),
        default="auto",
        show_default=True,
        help=help + " auto: the first model's own (float32 for a GGUF file), for both.",
    )(f)
