"""Putting a new directory where a finished one is, with no moment without a good copy.

One `renameat2(RENAME_EXCHANGE)` where the filesystem has it (Linux; ctypes, as Python has no binding);
else two renames, the old copy set aside first, whose failure puts the old copy back. The artifact store
(`pipeline.storage`) swaps every pulled or committed artifact in this way.
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
from pathlib import Path


def _exchange(a: Path, b: Path) -> None:
    """Swap two directories in one step (Linux `renameat2(RENAME_EXCHANGE)`); OSError where unsupported."""
    fn = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if fn is None:
        raise OSError(errno.ENOSYS, "renameat2 is not available")
    at_fdcwd, rename_exchange = -100, 2
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), str(a))


def replace_dir(new: Path, dest: Path, aside: Path) -> None:
    """Put directory `new` at `dest`, with no moment where `dest` is absent when it existed.

    One atomic exchange where the filesystem offers it; otherwise `dest` goes to `aside`, `new` to
    `dest`, and a failure of the second rename puts `aside` back before raising. The old copy is
    deleted last."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    if not dest.exists():
        os.replace(new, dest)
        return
    try:
        _exchange(new, dest)
        shutil.rmtree(new, ignore_errors=True)  # it holds the old copy now
        return
    except OSError:
        pass
    shutil.rmtree(aside, ignore_errors=True)
    aside.parent.mkdir(parents=True, exist_ok=True)
    os.replace(dest, aside)
    try:
        os.replace(new, dest)
    except BaseException:
        os.replace(aside, dest)
        raise
    shutil.rmtree(aside, ignore_errors=True)
