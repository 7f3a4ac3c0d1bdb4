"""Work queues of a background thread that takes everything queued at once.

A consumer thread blocks for the next item, then takes every item queued behind it, so one turn
handles a whole burst (one round trip for all of it); `STOP` tells it to return after the items
queued before it. Used by kv_offload's `OffloadWorker` and hstu_compute's onboard thread.
"""
from __future__ import annotations

import queue

STOP = object()  # put last: the consumer handles what came before it, then returns


def drain(q: queue.Queue, first) -> tuple[list, bool]:
    """``first`` and every item queued after it, up to ``STOP``: (the items, whether STOP came)."""
    items, item = [], first
    while item is not STOP:
        items.append(item)
        try:
            item = q.get_nowait()
        except queue.Empty:
            return items, False
    return items, True
