"""Files other processes read while they are written: written beside, then renamed into place."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

__all__ = ["replace_atomically"]


def replace_atomically(target: Path, write: Callable[[Path], None]) -> None:
    """``write(tmp)`` a file beside ``target``, then rename it over ``target``: a reader sees the
    old file or the new one, never part of one."""
    tmp = target.with_name(f"{target.name}.tmp.{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
