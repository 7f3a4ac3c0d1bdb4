"""Test entry point: the real store server whose copy thread sleeps before each copy.

    python tests/slow_store.py --copy-delay-s 3 --endpoint ipc://... [any python -m kvlifecycle.store option]

Tests use it to hold a task in flight (try_wait/cancel while it copies, an onboard that
outlasts kv_lookup_alloc's wait, a task in flight when the store dies). Everything but the
delay is `python -m kvlifecycle.store`.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from kvlifecycle.store import __main__ as store_main  # noqa: E402
from kvlifecycle.store.api import Status  # noqa: E402
from kvlifecycle.store.copy_worker import CopyTask, CopyWorker  # noqa: E402


class SlowCopyWorker(CopyWorker):
    """The store's copy thread, sleeping `delay_s` before each copy (after the task started)."""

    def __init__(self, delay_s: float) -> None:
        super().__init__()
        self.delay_s = delay_s

    def copy(self, task: CopyTask) -> Status:
        time.sleep(self.delay_s)
        return super().copy(task)


def main() -> int:
    parser = store_main.parser()
    parser.add_argument("--copy-delay-s", type=float, required=True, help="sleep before each copy")
    args = parser.parse_args()
    return store_main.serve(args, SlowCopyWorker(args.copy_delay_s))


if __name__ == "__main__":
    sys.exit(main())
