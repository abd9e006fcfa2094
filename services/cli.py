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
    from services.commands import main
except KeyboardInterrupt:
    sys.stderr.write("toolbus: interrupted while starting\n")
    raise SystemExit(130) from None

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
