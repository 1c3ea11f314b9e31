"""Whether the user asked normswap to stop: SIGINT (Ctrl-C) or SIGTERM (``kill``, ``timeout``), as a flag that
outlives the KeyboardInterrupt the signal raises.

A KeyboardInterrupt can be lost: raised inside a finalizer (``__del__``, a weakref callback) Python prints
"Exception ignored in ..." and goes on; a library that catches every exception turns it into another
error or drops it. The flag cannot be lost: the output's exchange (``normswap.io.staging.Staging.commit``)
asks whether a stop was asked for with the signals held (``held()``), immediately before it, and refuses
when one was, so an interrupted run never replaces the output, whatever became of the exception.

``Signals`` (the CLI, for the whole run) and ``watching()`` (a save through the Python API, where Python's
own SIGINT handler is installed) install the handler that sets the flag and raises KeyboardInterrupt.
Standard library only: every module may import it.
"""

from __future__ import annotations

import contextlib
import signal
import threading

SIGNALS = (signal.SIGINT, signal.SIGTERM)

_requested: signal.Signals | None = None


class Stopped(KeyboardInterrupt):
    """A stop that was asked for (the flag is set) and is honoured where it is checked, though the signal's
    own KeyboardInterrupt did not get there."""


def requested() -> signal.Signals | None:
    """The first signal (SIGINT or SIGTERM) that asked this run to stop, or ``None``."""
    return _requested


def request(signum: int) -> None:
    """Set the flag (the first signal is kept)."""
    global _requested
    if _requested is None:
        _requested = signal.Signals(signum)


def clear() -> None:
    """A new run: no stop asked for."""
    global _requested
    _requested = None


def settle() -> None:
    """Let the process end with the exit code it chose although a KeyboardInterrupt was handled on the way.

    CPython notes, for the whole process, a KeyboardInterrupt that leaves code compiled from a string
    (``exec``/``eval`` of source, as ``dataclasses`` and ``namedtuple`` build their methods while modules
    import) and at exit ends the process by SIGINT instead of by its exit code, even when the interrupt was
    caught further up (a shell then shows 130 for a SIGTERM). Evaluating source clears that note (CPython
    ``Python/pythonrun.c``: ``run_eval_code_obj``); an interrupt that really goes unhandled sets it again as
    it leaves the program (``Modules/main.c``: ``pymain_run_module``)."""
    eval("None")


def handler(signum, frame) -> None:
    """SIGINT and SIGTERM: set the flag and raise KeyboardInterrupt (as Python's own SIGINT handler)."""
    request(signum)
    raise KeyboardInterrupt


class Signals:
    """While the CLI runs (``with signals:``), SIGINT (Ctrl-C) and SIGTERM (``kill``, ``timeout``,
    ``docker stop``) set the flag and raise KeyboardInterrupt, as Python's own handler does for SIGINT, so
    that whatever a command was writing is removed on the way out (``normswap.io.staging``); ``seen`` says
    that one arrived and ``signum`` which came first. Some libraries catch every exception while they
    import a module and leave another error behind (transformers then reports "Could not import module
    'LlamaConfig'"), and a KeyboardInterrupt raised in a finalizer is printed and dropped, so the CLI asks
    ``seen``, not the exception, whether a signal stopped it.

    A second SIGTERM is ignored (the cleanup the first one started goes on; SIGKILL is the way to stop
    that); a second SIGINT interrupts again, as at any Python prompt. SIGTERM ignored by whoever started
    the process stays ignored. Outside the main thread: a no-op."""

    _inside = False
    _last: signal.Signals | None = None  # the flag as the run left it (cleared for whatever runs next)

    @property
    def seen(self) -> bool:
        """Whether a signal asked this run to stop."""
        return (_requested if self._inside else self._last) is not None

    @property
    def signum(self) -> signal.Signals:
        """The first signal of this run (SIGINT without one)."""
        return (_requested if self._inside else self._last) or signal.SIGINT

    @property
    def exit_code(self) -> int:
        """128 + the first signal's number (130 for SIGINT, 143 for SIGTERM); 130 without a signal."""
        return 128 + int(self.signum)

    @property
    def how(self) -> str:
        """How the command was stopped, as the interrupt line says it."""
        return "terminated by SIGTERM" if self.signum == signal.SIGTERM else "interrupted"

    def _handler(self, signum, frame):
        if self.seen and signum == signal.SIGTERM:
            return
        handler(signum, frame)

    def __enter__(self):
        clear()
        self._inside, self._last, self._previous = True, None, {}
        for number in SIGNALS:
            try:
                if number == signal.SIGTERM and signal.getsignal(number) == signal.SIG_IGN:
                    continue
                self._previous[number] = signal.signal(number, self._handler)
            except ValueError:  # not the main thread
                break
        return self

    quiet_after = False

    def __exit__(self, *exc):
        """Restore the handlers found on entering; with ``quiet_after`` (the CLI as a process of its own)
        SIGINT and SIGTERM get the system's default instead, for the rest of the process: the interpreter's
        shutdown after the command (seconds, for a process that held a model) ends at once, by the signal,
        with nothing printed (a shell's ``$?`` is 130 or 143). The command has printed and written
        everything by then (or said in one line why it stopped); nothing is left to undo. A signal the
        caller ignored stays ignored."""
        for number, previous in self._previous.items():
            if self.quiet_after and previous != signal.SIG_IGN:
                previous = signal.SIG_DFL
            signal.signal(number, previous if previous is not None else signal.SIG_DFL)
        self._previous, self._inside, self._last = {}, False, _requested
        clear()


@contextlib.contextmanager
def watching():
    """Within the block, where Python's own SIGINT handler is installed (the Python API, in the main
    thread), SIGINT also sets the flag (a new run: cleared first). Under the CLI (``Signals``), or with a
    handler of the caller's own, nothing changes."""
    installed = False
    if threading.current_thread() is threading.main_thread():
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            clear()
            signal.signal(signal.SIGINT, handler)
            installed = True
    try:
        yield
    finally:
        if installed:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            clear()


class _Held:
    """What ``held()`` gives its block: the signals that arrived within it (noted, their handlers not yet
    run)."""

    def __init__(self):
        self.noted: list[signal.Signals] = []

    def note(self, signum, frame) -> None:
        self.noted.append(signal.Signals(signum))

    def asked(self) -> signal.Signals | None:
        """The signal that asked to stop, before the block or within it so far; ``None`` when none did."""
        return requested() or (self.noted[0] if self.noted else None)


@contextlib.contextmanager
def held():
    """Within the block, the Python handlers of SIGINT and SIGTERM only note a signal (``asked()``): no
    KeyboardInterrupt interrupts the block halfway, whichever thread the system gave the signal to. A
    signal already due runs its handler on entering (its KeyboardInterrupt, the flag set); one noted
    within the block runs its handler on leaving, after the block's work. A signal whose handler is the
    system's (SIGTERM by default outside the CLI) still acts at once. Outside the main thread: only
    ``asked()``."""
    hold, previous = _Held(), {}
    try:
        for number in SIGNALS:
            handler_now = signal.getsignal(number)
            if callable(handler_now):
                signal.signal(number, hold.note)  # runs a handler already due first (it may raise)
                previous[number] = handler_now
    except ValueError:  # not the main thread
        pass
    except BaseException:
        for number, handler_then in previous.items():
            signal.signal(number, handler_then)
        raise
    try:
        yield hold
    finally:
        for number, handler_then in previous.items():
            signal.signal(number, handler_then)
        for signum in hold.noted:  # delivered now, as if it had come after the block
            handler_then = previous.get(signum)
            if callable(handler_then):
                handler_then(signum, None)
