"""The store server's copy thread (`kvlifecycle.store.copy_worker`), in process: tasks run one at a
time in arrival order through their pool's backing; a task cancelled or past its start deadline
before its turn never reaches the backing; a done status is reported once."""

from __future__ import annotations

import threading
import time
from typing import Any, Iterator

import numpy as np
import pytest

from kvlifecycle.pool import PagePool
from kvlifecycle.store.api import Status
from kvlifecycle.store.backing import Backing
from kvlifecycle.store.copy_worker import CopyTask, CopyWorker
from kvlifecycle.store.pools import PoolRegistry
from kvlifecycle.store.protocol import Op
from kvlifecycle.store.transfer import PageCopier

from .store_harness import NS, SPEC, tokens


class GatedBacking(Backing):
    """Records the pool pages of each copy in order; a copy waits until the test opens the gate."""

    def __init__(self) -> None:
        self.copied: list[tuple[str, list[int]]] = []
        self.started = threading.Event()
        self.gate = threading.Event()

    def held_prefix(self, keys: list[bytes]) -> int:
        return 0

    def put(self, copier: PageCopier, pool_pages: np.ndarray, keys: list[bytes]) -> Status:
        return self._copy("put", pool_pages)

    def get(self, copier: PageCopier, pool_pages: np.ndarray, keys: list[bytes]) -> Status:
        return self._copy("get", pool_pages)

    def stats(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        return None

    def _copy(self, op: str, pool_pages: np.ndarray) -> Status:
        self.started.set()
        assert self.gate.wait(10), "the test never opened the gate"
        self.copied.append((op, pool_pages.tolist()))
        return Status.SUCCESS


@pytest.fixture
def setup() -> Iterator[tuple[CopyWorker, GatedBacking, Any]]:
    backing = GatedBacking()
    registry = PoolRegistry(lambda page_shape, dtype, pin_memory: backing)
    with PagePool.create(SPEC) as pool:
        attached = registry.get(registry.attach(pool.handle()))
        worker = CopyWorker()
        worker.start()

        def task(task_id: int, op: Op, pages: list[int], start_in_s: float = 10.0) -> CopyTask:
            return CopyTask(client="c", task_id=task_id, op=op, pool=attached, namespace=NS,
                            tokens=tokens(len(pages)), seq_pages=np.arange(len(pages)),
                            pool_pages=np.asarray(pages), start_by=time.monotonic() + start_in_s)

        try:
            yield worker, backing, task
        finally:
            backing.gate.set()
            worker.stop()


def test_fifo_cancel_and_expiry_are_decided_before_a_task_starts(setup):
    worker, backing, task = setup
    worker.submit(task(1, Op.PUT, [1, 2]))
    assert backing.started.wait(10)  # task 1 is copying, held at the gate
    worker.submit(task(2, Op.GET, [3]))
    worker.submit(task(3, Op.PUT, [4]))
    worker.submit(task(4, Op.PUT, [5], start_in_s=0.05))  # its deadline passes while it waits
    worker.submit(task(5, Op.GET, [6]))

    worker.cancel("c", [1, 3])  # 1 has started: too late; 3 is queued: cancelled
    time.sleep(0.1)  # past task 4's start deadline, all still behind task 1
    assert worker.poll("c", [1, 2, 3]) == {1: Status.UNREADY, 2: Status.UNREADY, 3: Status.CANCELLED}
    assert backing.copied == [], "nothing finished while the gate was shut"

    backing.gate.set()
    deadline = time.monotonic() + 10
    statuses: dict[int, Status] = {}
    while len(statuses) < 4 and time.monotonic() < deadline:
        statuses.update({t: s for t, s in worker.poll("c", [1, 2, 4, 5]).items() if s.done and t not in statuses})
        time.sleep(0.01)
    assert statuses == {1: Status.SUCCESS, 2: Status.SUCCESS, 4: Status.FAILED, 5: Status.SUCCESS}
    assert backing.copied == [("put", [1, 2]), ("get", [3]), ("get", [6])], "arrival order; 3 and 4 never copied"
    assert worker.stats()["expired_tasks"] == 1


def test_a_done_status_is_reported_once_and_an_unknown_task_is_failed(setup):
    worker, backing, task = setup
    backing.gate.set()
    worker.submit(task(7, Op.PUT, [1]))
    deadline = time.monotonic() + 10
    while (first := worker.poll("c", [7])) == {7: Status.UNREADY}:
        assert time.monotonic() < deadline, "task 7 never finished"
        time.sleep(0.01)
    assert first == {7: Status.SUCCESS}
    assert worker.poll("c", [7]) == {7: Status.FAILED}, "reported once, then forgotten (as a lost task)"
    assert worker.poll("other-client", [7]) == {7: Status.FAILED}, "task ids are per client"
    with pytest.raises(ValueError, match="already submitted"):
        worker.submit(task(8, Op.PUT, [1]))
        worker.submit(task(8, Op.PUT, [1]))
