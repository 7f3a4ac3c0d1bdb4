"""Test entry point: the real store server whose copy thread sleeps before each copy, or whose
socket thread sleeps before each match (a `get_match`, or the match of a `get_prefix`).

    python tests/slow_store.py --copy-delay-s 3 --endpoint ipc://... [any python -m kvlifecycle.store option]
    python tests/slow_store.py --match-delay-s 3 --endpoint ipc://...

Tests use it to hold a task in flight (try_wait/cancel while it copies, an onboard that
outlasts kv_lookup_alloc's wait, a task in flight when the store dies), or to stall the store's
answers (every RPC queued behind a match waits too). Everything but the delays is
`python -m kvlifecycle.store`.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from kvlifecycle.store import __main__ as store_main  # noqa: E402
from kvlifecycle.store.api import Status  # noqa: E402
from kvlifecycle.store.copy_worker import CopyTask, CopyWorker  # noqa: E402
from kvlifecycle.store.server import StoreServer  # noqa: E402


class SlowCopyWorker(CopyWorker):
    """The store's copy thread, sleeping `delay_s` before each copy (after the task started)."""

    def __init__(self, delay_s: float) -> None:
        super().__init__()
        self.delay_s = delay_s

    def copy(self, task: CopyTask) -> Status:
        time.sleep(self.delay_s)
        return super().copy(task)


def slow_match_server(delay_s: float) -> type[StoreServer]:
    class SlowMatchStoreServer(StoreServer):
        """The store server, its socket thread sleeping `delay_s` before each match."""

        def _match(self, *args):
            time.sleep(delay_s)
            return super()._match(*args)

    return SlowMatchStoreServer


def main() -> int:
    parser = store_main.parser()
    parser.add_argument("--copy-delay-s", type=float, default=0.0, help="sleep before each copy")
    parser.add_argument("--match-delay-s", type=float, default=0.0, help="sleep before each match")
    args = parser.parse_args()
    return store_main.serve(args, SlowCopyWorker(args.copy_delay_s), slow_match_server(args.match_delay_s))


if __name__ == "__main__":
    sys.exit(main())
