"""Test entry point: the real store server whose copy thread sleeps before each copy, or whose
socket thread sleeps before each match (the match of a `get_prefix`, or a `locate`).

    python tests/slow_store.py --copy-delay-s 3 --endpoint ipc://... [any python -m kvlifecycle.store option]
    python tests/slow_store.py --match-delay-s 3 --endpoint ipc://...
    python tests/slow_store.py --hold copy --hold-file PATH --log-file LOG --endpoint ipc://...

Tests use it to hold a task in flight (try_wait/cancel while it copies, an onboard that
outlasts kv_lookup_alloc's wait, a task in flight when the store dies), or to stall the store's
answers (every RPC queued behind a match waits too). With `--hold copy` (or `match`) each copy
(or match) also waits, after its delay, for as long as `--hold-file` exists (at most
`HOLD_MAX_S`): the test decides when it ends. `--log-file` gets a line as each copy or match
starts and one as it ends ("copy start", "copy done", ...), so a test can tell that the store
was asked, and that it had not answered yet. Everything but the delays and holds is
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

HOLD_MAX_S = 120.0  # a hold file left behind (a test that died) stalls the store no longer than this


class Stall:
    """What a copy or a match does first: log its start, sleep `delay_s`, then wait while
    `hold_file` exists (when given)."""

    def __init__(self, what: str, delay_s: float, hold_file: Path | None, log_file: Path | None) -> None:
        self.what, self.delay_s, self.hold_file, self.log_file = what, delay_s, hold_file, log_file

    def log(self, event: str) -> None:
        if self.log_file is not None:
            with open(self.log_file, "a") as f:
                f.write(f"{self.what} {event}\n")

    def __call__(self, step):
        self.log("start")
        time.sleep(self.delay_s)
        deadline = time.monotonic() + HOLD_MAX_S
        while self.hold_file is not None and self.hold_file.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        try:
            return step()
        finally:
            self.log("done")


class SlowCopyWorker(CopyWorker):
    """The store's copy thread, stalled by `stall` before each copy (after the task started)."""

    def __init__(self, stall: Stall) -> None:
        super().__init__()
        self.stall = stall

    def copy(self, task: CopyTask) -> Status:
        return self.stall(lambda: super(SlowCopyWorker, self).copy(task))


def slow_match_server(stall: Stall) -> type[StoreServer]:
    class SlowMatchStoreServer(StoreServer):
        """The store server, its socket thread stalled by `stall` before each match."""

        def _page_keys(self, *args):  # a get_prefix's match starts with its keys
            return stall(lambda: super(SlowMatchStoreServer, self)._page_keys(*args))

        def _locate(self, *args):  # a reader's match
            return stall(lambda: super(SlowMatchStoreServer, self)._locate(*args))

    return SlowMatchStoreServer


def main() -> int:
    parser = store_main.parser()
    parser.add_argument("--copy-delay-s", type=float, default=0.0, help="sleep before each copy")
    parser.add_argument("--match-delay-s", type=float, default=0.0, help="sleep before each match")
    parser.add_argument("--hold", choices=("copy", "match"), help="copies, or matches, wait while --hold-file exists")
    parser.add_argument("--hold-file", type=Path)
    parser.add_argument("--log-file", type=Path, help="a line as each copy or match starts and ends")
    args = parser.parse_args()
    if args.hold and args.hold_file is None:
        parser.error("--hold needs --hold-file")

    def stall(what: str, delay_s: float) -> Stall:
        return Stall(what, delay_s, args.hold_file if args.hold == what else None, args.log_file)

    return store_main.serve(args, SlowCopyWorker(stall("copy", args.copy_delay_s)),
                            slow_match_server(stall("match", args.match_delay_s)))


if __name__ == "__main__":
    sys.exit(main())
