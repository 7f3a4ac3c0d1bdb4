"""hstu_compute's answers sent from a thread of its own, once a forward's scores reach the host.

With `HSTU_COMPUTE_ANSWERS=thread`, `execute` launches a sub-batch's forward,
queues the copy of its scores to pinned host memory behind it, records an event, hands all that
to this thread (`AnswerThread.submit`) and returns. The stub takes the next batch while the GPU
computes this one: the next batch's host work (parsing, batching, launching) overlaps this one's
GPU time, which a forward replayed from a CUDA graph leaves almost entirely to the GPU. The thread
waits for the event (the GIL released), has the scores sealed into answers and sends each one
through its request's response sender: tritonserver's Python backend (24.06 on) lets a
non-decoupled model answer a request once through its sender; `execute` returns None for it.

Nothing here computes: a forward runs only on `execute`'s thread. Whatever must happen before a
request is answered happened before `submit` (its onboard copy checked, the owner told which pages
were copied); the KV the forward writes is in the pool once the event completed, before kv_offload
commits it on the answer.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import triton_python_backend_utils as pb_utils

from deploy.runtime.triton_io import error_response
from deploy.runtime.triton_metrics import StageTimer

logger = logging.getLogger(__name__)

__all__ = ["AnswerThread", "ScoredBatch"]

_STOP = None


@dataclass
class ScoredBatch:
    """A launched forward's scores on their way to the host, and whom to answer with them."""

    ready: torch.cuda.Event | None  # completes once `scores` holds the forward's scores (None: it does)
    scores: torch.Tensor  # [sum c, num_tasks] float32 in pinned host memory, written by the queued copy
    candidates: list[int]  # each member's c, in order
    senders: list[Any]  # each member's response sender; None: a member answered otherwise (computed again)
    lease_ids: list[int]  # each member's lease, aborted if the forward failed
    started: float  # time.perf_counter() when the forward was launched


class AnswerThread:
    """Answers `ScoredBatch`es in order, from one daemon thread (module docstring)."""

    def __init__(self, respond: Callable[[torch.Tensor, list[int]], list[Any]], abort: Callable[[int], None],
                 stages: StageTimer) -> None:
        self._respond = respond  # (host scores [sum c, num_tasks], each member's c) -> each member's answer
        self._abort = abort
        self._stages = stages  # the thread adds the stages "compute" and "compute_call"
        self._queue: queue.SimpleQueue[ScoredBatch | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="hstu-compute-answers", daemon=True)
        self._thread.start()

    def submit(self, batch: ScoredBatch) -> None:
        self._queue.put(batch)

    def close(self, timeout_s: float = 10.0) -> None:
        """Answer what was submitted, then stop."""
        self._queue.put(_STOP)
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while (batch := self._queue.get()) is not _STOP:
            self._answer(batch)

    def _answer(self, batch: ScoredBatch) -> None:
        answered = [i for i, sender in enumerate(batch.senders) if sender is not None]
        try:
            if batch.ready is not None:
                batch.ready.synchronize()  # the GIL is released while it waits
            seconds = time.perf_counter() - batch.started
            self._stages.add("compute", seconds, len(answered))  # one computed again counts once, there
            self._stages.add("compute_call", seconds)
            responses = dict(enumerate(self._respond(batch.scores, batch.candidates)))
        except Exception as e:  # the forward failed on the device: its requests fail, their pages return
            logger.error("hstu_compute: a batch of %d failed on the device", len(batch.senders), exc_info=True)
            for i in answered:
                self._abort(batch.lease_ids[i])
            responses = {i: error_response(f"hstu_compute: {e}") for i in answered}
        for i in answered:
            try:
                batch.senders[i].send(responses[i], flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            except Exception:  # the client is gone, or the server stops: nothing left to answer
                logger.warning("hstu_compute: cannot send the answer of lease %d", batch.lease_ids[i], exc_info=True)
