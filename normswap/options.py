"""click options shared by several commands; importing this module imports no torch (fast ``--help``)."""

from __future__ import annotations

import re
from pathlib import Path

import click

from normswap import stop
from normswap.errors import NormswapError

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
          "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}  # fmt: skip
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*", re.IGNORECASE)


def parse_size(text: str) -> int:
    """``"2GiB"`` -> 2147483648, ``"1.5GB"`` -> 1500000000, ``"512MiB"``, ``"64KB"``, ``"1000"`` (bytes).

    Units, any case: B, K/KB, M/MB, G/GB, T/TB (powers of 1000, as accelerate's ``max_memory``) and KiB,
    MiB, GiB, TiB (powers of 1024).

    Raises:
        ValueError: not such a size, or not positive (the message gives examples).
    """
    match = _SIZE.fullmatch(str(text))
    unit = match and _UNITS.get(match.group(2).lower())
    if not unit:
        raise ValueError(f"{text!r} is not a size (examples: 2GiB, 1.5GB, 512MiB)")
    size = int(float(match.group(1)) * unit)
    if size <= 0:
        raise ValueError(f"{text!r} must be positive")
    return size


def _name(param) -> str:
    return max(param.opts, key=len) if param is not None and param.opts else "value"


def size_option(name: str, **kwargs):
    """A click option whose value is a size string (``parse_size``); a bad one is bad input (one line, exit
    2) at once, before any heavy import."""

    def check(ctx, param, value):
        if value is not None:
            try:
                parse_size(value)
            except ValueError as error:
                raise NormswapError(f"{_name(param)} {error}") from None
        return value

    return click.option(name, callback=check, metavar="SIZE", **kwargs)


def device_option(f):
    """The ``--device`` option of convert, inspect, check, eval and zoo (see ``device.resolve_device``)."""
    return click.option(
        "--device",
        default="auto",
        show_default=True,
        help="Where the model runs: auto (the first CUDA GPU if any, else the CPU), cpu, cuda or cuda:N. "
        "Ignored with --device-map.",
    )(f)


# Names that say "a file" to a user: an output directory named so would surprise (-o model.safetensors)
_FILE_SUFFIXES = tuple(".safetensors .bin .pt .pth .ckpt .gguf .json .onnx .h5 .msgpack".split())


class OutputPath(click.Path):
    """A path a command writes to: ``--output`` (a directory, ``directory=True``) or a report file.

    Refused at once, as bad input (one line, exit 2): an empty value (``-o ''`` would be the current
    directory), and for a directory a name with a model file's suffix (``-o model.safetensors``: the
    checkpoint is a folder of files, so that would create a folder named like a file).
    """

    def __init__(self, *, directory: bool = False) -> None:
        super().__init__(path_type=Path)  # what may exist there is checked by normswap.io, in one line
        self.directory = directory

    def convert(self, value, param, ctx):
        if isinstance(value, str):
            problem = output_problem(_name(param), value, directory=self.directory)
            if problem:
                raise NormswapError(problem)
        return super().convert(value, param, ctx)


def output_problem(name: str, value: str, *, directory: bool) -> str | None:
    """Why ``value`` cannot be the output ``name`` (``--output``: a ``directory``, or a report file), or
    None: an empty value (the current directory), a directory named like a model file."""
    if not value.strip():
        return f"{name} is empty; name a {'directory' if directory else 'file'}"
    if directory and value.lower().rstrip("/").endswith(_FILE_SUFFIXES):
        name_ = value.rstrip("/")
        stem = name_.rsplit(".", 1)[0] or "converted"
        return (
            f"{name} {name_!r} names a file, but the converted checkpoint is a directory (config.json, "
            f"model.safetensors, normswap.json, ...); name a directory, e.g. {stem + '-normswap'!r}"
        )
    return None


def model_name(ctx, param, value):
    """click callback of a MODEL argument or option: a mistyped short name (``SmolLM2-135M``) is answered at
    once, before the heavy imports and without asking the hub (``normswap.catalog.misspelled``)."""
    from normswap.catalog import misspelled

    problem = misspelled(value) if isinstance(value, str) else None
    if problem:
        raise NormswapError(problem)
    return value


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


class Command(click.Command):
    """A command whose body runs torch. torch's import runs Python code from C++ (pybind11), and a
    KeyboardInterrupt raised there aborts the process (seen: exit -6, "terminate called after throwing ...
    error_already_set"): SIGINT and SIGTERM are held while it imports, after the options are parsed (a usage
    error imports nothing), and act once it has (``stop.held``)."""

    def invoke(self, ctx: click.Context):
        with stop.held():
            import torch  # noqa: F401
        return super().invoke(ctx)
