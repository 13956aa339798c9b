"""The ``stocfl`` command's entry point (and ``stocfl-lab``'s), kept outside the stocfl package.

Importing stocfl (torch, Flower, scikit-learn) takes seconds; a Ctrl-C or a SIGTERM in them
used to end the command with a traceback of whatever was being imported. This module imports
nothing heavy itself, so it can catch them: one line, nothing run, exit code 130 (Ctrl-C) or
143 (SIGTERM). Once stocfl is imported, its command line handles both (the run stops at its
last checkpoint, and says so).
"""

from __future__ import annotations

import importlib
import signal
import sys


class _Terminated(KeyboardInterrupt):
    pass


def _on_sigterm(signum, frame):
    raise _Terminated


def launch(prog: str, module: str, name: str = "main") -> int:
    """``module.name()``, a command's main, with the import of ``module`` guarded."""
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        command = getattr(importlib.import_module(module), name)
    except KeyboardInterrupt as err:
        what = "terminated (SIGTERM)" if isinstance(err, _Terminated) else "interrupted"
        print(f"{prog}: {what} while starting; nothing was run", file=sys.stderr)
        return 143 if isinstance(err, _Terminated) else 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    return command()


def main() -> int:
    return launch("stocfl", "stocfl.cli")
