"""The one exception type normswap raises for bad input.

A ``NormswapError`` carries one line that names the problem (and, where it helps, what to do about it).
The CLI prints it on stderr as ``normswap: error: <line>`` and exits with code 2; library callers catch it
like any other exception. Bugs inside normswap are not wrapped: they surface as their own exceptions.
"""

from __future__ import annotations


class NormswapError(Exception):
    """Bad input to normswap: an unknown model, a missing or corrupt file, an unusable output directory.

    ``str(error)`` is a single line suitable for a terminal.
    """
