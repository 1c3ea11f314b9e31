"""``python -m normswap`` and the ``normswap`` command: the command-line interface (``normswap.cli``)."""

import sys


def run() -> None:
    """Run the CLI. Ctrl-C exits 130 also while the CLI is still being imported (``normswap.cli.main``
    answers it at every later moment)."""
    try:
        from normswap.cli import main
    except KeyboardInterrupt:
        print("\nnormswap: interrupted; nothing was written", file=sys.stderr)
        sys.exit(130)
    main()


if __name__ == "__main__":
    run()
