"""The entry points' common ending: bad input is one line naming it and exit 2, not a traceback."""

from __future__ import annotations

import errno
import os
import sys

# Errors that mean "your input is wrong" (a config value, a missing file, a checkpoint of another run, a lock held):
# ConfigError and CheckpointError are ValueErrors. A bug raises something else and keeps its traceback.
INPUT_ERRORS = (ValueError, KeyError, FileNotFoundError, RuntimeError)
INPUT_ERROR_EXIT = 2


def run_main(main, argv=None):
    """main(argv) with input errors reported as `error: ...` on stderr and exit 2 (DFLASH_TRACEBACK=1 re-raises).
    A `SystemExit("message")` (the scripts' way to stop on a named problem) reads and exits the same; a disk that
    fills while a result is written (OSError ENOSPC, EDQUOT) names the file and exits 2 too."""
    try:
        return main(argv)
    except INPUT_ERRORS as e:
        if os.environ.get("DFLASH_TRACEBACK"):
            raise
        _refuse(str(e))
    except SystemExit as e:
        if not isinstance(e.code, str):
            raise
        _refuse(e.code.removeprefix("error: "))
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT) or os.environ.get("DFLASH_TRACEBACK"):
            raise
        _refuse(f"{e.filename or 'a file'}: {e.strerror}: free space there and run the command again")


def _refuse(message: str) -> None:
    print(f"error: {message}\n(set DFLASH_TRACEBACK=1 for the traceback)", file=sys.stderr)
    sys.exit(INPUT_ERROR_EXIT)


def add_xla_flags(flags: str) -> None:
    """Append `flags` (space-separated `--name=value`) to XLA_FLAGS, which XLA reads once, when JAX first starts a
    backend: call it before any computation. A flag the environment sets already keeps the environment's value."""
    have = os.environ.get("XLA_FLAGS", "").split()
    names = {f.split("=", 1)[0] for f in have}
    extra = [f for f in flags.split() if f.split("=", 1)[0] not in names]
    for f in extra:
        if not f.startswith("--"):
            raise ValueError(f"xla_flags: {f!r} is not an XLA flag (expected --name=value)")
    if extra:
        os.environ["XLA_FLAGS"] = " ".join([*have, *extra])
