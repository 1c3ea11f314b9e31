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
