"""The `toolbus` command.

A small module on purpose: `python -m services.cli` compiles the module it runs before any
of its code can guard anything, so the commands live in `services.commands` and are loaded
under the guard below. A Ctrl-C while they load (the first fraction of a second) ends the
command with one line and the usual status, not a traceback of whichever import it hit.
"""

from __future__ import annotations

import sys

try:
    from services.process import note_interrupts

    note_interrupts()
    from collections.abc import Sequence

    from services.commands import main as _main
except KeyboardInterrupt:
    sys.stderr.write("toolbus: interrupted while starting\n")
    raise SystemExit(130) from None


def main(argv: Sequence[str] | None = None) -> int:
    """The command, and one line for a Ctrl-C that reaches no handler of its own (one
    landing while the arguments are read, on a slow machine, raised out of argparse)."""
    try:
        return _main(argv)
    except KeyboardInterrupt:
        sys.stderr.write("toolbus: interrupted\n")
        return 130


__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
