"""Progress lines and stage timings of long commands: what is happening now, and how long each stage took.

Library code says what it is doing with :func:`note` and times its stages with :class:`Stages`; nothing is
printed unless a front end turned progress lines on with :func:`show` (the CLI does exactly when stderr is a
terminal, so scripts and logs see results and errors only). Timings are recorded either way: ``convert``
puts them in its report as ``timings`` (stage name -> seconds).

Example::

    stages = Stages()
    stages.start("load", "smollm2-135m (float32)")   # "normswap: load: smollm2-135m (float32) ..."
    model = load(...)
    stages.start("walk", "finding the norms")         # "normswap: load: 11.9 s", then the next line
    ...
    stages.stop()                                     # "normswap: walk: 0.4 s"
    stages.timings                                    # {"load": 11.93, "walk": 0.41}

``with stages.stage("check", "comparing the logits"): ...`` times one block the same way.
"""

from __future__ import annotations

import contextlib
import sys
import time

_showing = False


def show(on: bool = True) -> None:
    """Turn progress lines on (``True``) or off. Off by default: a library prints nothing."""
    global _showing
    _showing = bool(on)


def showing() -> bool:
    """Whether progress lines are on (see :func:`show`); also tells helpers such as the short-name fetch
    whether to let a subprocess draw its own progress bar."""
    return _showing


def note(message: str) -> None:
    """Write ``normswap: {message}`` to stderr when progress lines are on."""
    if _showing:
        print(f"normswap: {message}", file=sys.stderr, flush=True)


def say(message: str) -> None:
    """Write ``normswap: {message}`` to stderr, progress lines on or off (a decision the user must see)."""
    print(f"normswap: {message}", file=sys.stderr, flush=True)


def seconds(value: float) -> str:
    """``0.042`` -> ``"0.04 s"``, ``11.93`` -> ``"11.9 s"``, ``183.2`` -> ``"3 min 3 s"``."""
    if value < 1:
        return f"{value:.2f} s"
    if value < 100:
        return f"{value:.1f} s"
    minutes, rest = divmod(round(value), 60)
    return f"{minutes} min {rest} s"


def size(nbytes: int) -> str:
    """``32768`` -> ``"32.0 KiB"``: bytes in the largest binary unit that keeps the number at least 1."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"


class Stages:
    """Wall-clock seconds (``time.perf_counter``) of the named stages of one run, in the order they ran.

    Attributes:
        timings: stage name -> seconds, rounded to milliseconds; a stage started twice adds up.
        current: the name of the stage running now, or ``None``.
    """

    def __init__(self) -> None:
        self.timings: dict[str, float] = {}
        self.current: str | None = None
        self._since = 0.0

    def start(self, name: str, message: str | None = None) -> None:
        """End the running stage (if any, see :meth:`stop`) and start ``name``; note ``name: message ...``."""
        self.stop()
        note(f"{name}: {message} ..." if message else f"{name} ...")
        self.current, self._since = name, time.perf_counter()

    def stop(self, detail: str | None = None, *, quiet: bool = False) -> None:
        """End the running stage: record its time and note ``name: [detail, ]T s`` (not when ``quiet``).
        No-op when no stage runs."""
        if self.current is None:
            return
        elapsed = time.perf_counter() - self._since
        name, self.current = self.current, None
        self.timings[name] = round(self.timings.get(name, 0.0) + elapsed, 3)
        if not quiet:
            note(f"{name}: {detail + ', ' if detail else ''}{seconds(elapsed)}")

    @contextlib.contextmanager
    def stage(self, name: str, message: str | None = None):
        """Time the block as stage ``name``: :meth:`start` before, :meth:`stop` after. On an error the stage
        stays :attr:`current`, so that whoever handles the error (an interrupt) can tell where it was."""
        self.start(name, message)
        yield self
        self.stop()

    def total(self) -> float:
        """Seconds of all stages together."""
        return round(sum(self.timings.values()), 3)
