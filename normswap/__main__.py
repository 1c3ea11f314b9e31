"""``python -m normswap`` and the ``normswap`` command: the command-line interface (``normswap.cli``)."""

import signal
import sys


class _Terminated(BaseException):
    """SIGTERM while the CLI is still being imported."""


def _terminated(signum, frame):
    raise _Terminated


def run() -> None:
    """Run the CLI. Ctrl-C (SIGTERM) exits 130 (143) with one line also while the CLI is still being
    imported (``normswap.cli.main`` answers them at every later moment); nothing is written by then."""
    installed = False
    try:
        if signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:  # SIGTERM ignored by the caller stays so
            signal.signal(signal.SIGTERM, _terminated)
            installed = True
    except ValueError:  # not the main thread
        pass
    try:
        from normswap.cli import main

        if installed:  # the CLI installs its own handler while it runs; the default one around it
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
    except KeyboardInterrupt:
        _last_line("interrupted", 130, newline=True)
    except _Terminated:
        _last_line("terminated by SIGTERM", 143)
    main()


def _last_line(how: str, code: int, newline: bool = False) -> None:
    """Write ``normswap: {how}; nothing was written`` (after a newline that ends a terminal's ``^C`` echo,
    when ``newline`` and stderr is a terminal) and exit ``code``."""
    start = "\n" if newline and sys.stderr.isatty() else ""
    print(f"{start}normswap: {how}; nothing was written", file=sys.stderr)
    from normswap import stop  # standard library only

    stop.settle()  # the interrupt is handled: exit with code, not by SIGINT
    sys.exit(code)


if __name__ == "__main__":
    run()
