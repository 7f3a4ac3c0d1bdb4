"""Commits announced without a round trip: kv_offload tells the owner, and answers at once.

kv_offload must make a batch's pages visible before it answers: a client's next request, sent
once it has the answer, must find them. A commit round trip to the owner did that, and cost
kv_offload's `execute` the owner's control thread waking, the commit and the reply: 0.36-0.67 ms
of a c=1 request on the 2-core CPU machine, two thirds of kv_offload's step.

Instead kv_offload sends the batch's lease ids as one datagram on a Unix datagram socket
(``CommitSender.send``). A datagram is in the owner's socket queue when ``sendto`` returns, so it
is there before the answer leaves kv_offload. The owner applies what is queued
(``CommitInbox.drain``) on its control thread as soon as it arrives, and on its `execute` thread
before every lookup; both drain under one lock that a thread holds from taking a datagram until
its commits are applied. So a lookup that follows an answer always sees that answer's commit:
either it drains the datagram itself, or it waits for the thread that took it. Nothing is
waited for in the common case: the control thread has applied it while the answer travelled.

Each datagram names the endpoint (a zmq PULL socket of kv_offload's offload worker) that the
owner sends the commits' ``Committed`` to (the pages to offload, pinned until ``offload_done``);
the control thread sends them, off every request's path.

    datagram: magic b"KVC1" | endpoint length u16 | endpoint utf-8 | lease ids int64 ...
    to the endpoint: kvlifecycle.rpc frames {"committed": [Committed.to_json(), ...]}

The same inbox takes the reader's report (``CommitSender.report_read``): hstu_compute, which
copies host hits from the store's shared slab itself, says how many leading onboard pages of
each lease it copied, so that the commit does not offload them back into the store that holds
them (``LeaseTable.reader_copied``). hstu_compute sends it before its answer leaves, so it is in
the inbox before the commit datagram kv_offload sends on that answer (one socket queue, in order
of sending). A report that could not be sent, or that arrives after a round-trip commit, only
costs the status quo: those pages are offered to the store, which skips the keys it holds.

    datagram: magic b"KVR1" | n u16 | lease ids int64 * n | copied pages int64 * n

A sender that cannot deliver (no inbox: the owner is not running yet or restarted; the queue is
full: the owner stalls) gets False and commits with a round trip instead (``ControlClient``):
never slower than before, and never unannounced.
"""
from __future__ import annotations

import errno
import logging
import os
import socket
import struct
import threading
from typing import Sequence

import numpy as np

from kvlifecycle.page_table import Committed

logger = logging.getLogger(__name__)

__all__ = ["CommitInbox", "CommitSender", "inbox_path"]

MAGIC = b"KVC1"
READ_MAGIC = b"KVR1"
_HEADER = struct.Struct("<4sH")  # magic, then the endpoint's length (KVC1) or the count of leases (KVR1)
MAX_LEASES = 4096  # per datagram: 32 KiB of ids, well within a Unix datagram's limit


def inbox_path(control_endpoint: str) -> str:
    """The owner's inbox socket, beside its control socket (``ipc://PATH`` -> ``PATH.commits``)."""
    if not control_endpoint.startswith("ipc://"):
        raise ValueError(f"control endpoint: expected ipc://PATH, got {control_endpoint!r}")
    return control_endpoint[len("ipc://"):] + ".commits"


def encode(endpoint: str, lease_ids: Sequence[int]) -> bytes:
    name = endpoint.encode()
    return _HEADER.pack(MAGIC, len(name)) + name + np.asarray(lease_ids, dtype="<i8").tobytes()


def decode(datagram: bytes) -> tuple[str, list[int]]:
    """(endpoint, lease ids); ValueError for anything else."""
    if len(datagram) < _HEADER.size:
        raise ValueError(f"commit datagram of {len(datagram)} bytes: shorter than its header")
    magic, name_len = _HEADER.unpack_from(datagram)
    ids = datagram[_HEADER.size + name_len:]
    if magic != MAGIC or len(ids) % 8:
        raise ValueError(f"commit datagram: bad magic {magic!r} or {len(ids)} id bytes (not int64s)")
    endpoint = datagram[_HEADER.size:_HEADER.size + name_len].decode()
    return endpoint, np.frombuffer(ids, dtype="<i8").tolist()


def encode_read(lease_ids: Sequence[int], pages: Sequence[int]) -> bytes:
    assert len(lease_ids) == len(pages), "encode_read: one count of copied pages per lease"
    return (_HEADER.pack(READ_MAGIC, len(lease_ids)) + np.asarray(lease_ids, dtype="<i8").tobytes()
            + np.asarray(pages, dtype="<i8").tobytes())


def decode_read(datagram: bytes) -> tuple[list[int], list[int]]:
    """(lease ids, copied pages) of a reader's report; ValueError for anything else."""
    magic, n = _HEADER.unpack_from(datagram) if len(datagram) >= _HEADER.size else (b"", -1)
    if magic != READ_MAGIC or len(datagram) != _HEADER.size + 16 * n:
        raise ValueError(f"read datagram: bad magic {magic!r} or {len(datagram)} bytes for {n} leases")
    values = np.frombuffer(datagram, dtype="<i8", offset=_HEADER.size)
    return values[:n].tolist(), values[n:].tolist()


class CommitSender:
    """kv_offload's side: ``send(lease_ids) -> bool``. Not thread-safe (its caller's thread)."""

    def __init__(self, control_endpoint: str, reply_endpoint: str) -> None:
        self.path = inbox_path(control_endpoint)
        self.reply_endpoint = reply_endpoint
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.setblocking(False)

    def send(self, lease_ids: Sequence[int]) -> bool:
        """Queue the commit of ``lease_ids`` in the owner's inbox; False when it cannot be queued
        now (the caller commits with a round trip instead)."""
        if not lease_ids or len(lease_ids) > MAX_LEASES:
            return False
        return self._send(encode(self.reply_endpoint, lease_ids))

    def _send(self, datagram: bytes) -> bool:
        try:
            self._sock.sendto(datagram, self.path)
            return True
        except (FileNotFoundError, ConnectionRefusedError, BlockingIOError):  # no owner, or it stalls
            return False
        except OSError as e:
            if e.errno in (errno.EMSGSIZE, errno.ENOBUFS):
                return False
            raise

    def report_read(self, lease_ids: Sequence[int], pages: Sequence[int]) -> bool:
        """The reader's report: it copied the first ``pages[i]`` onboard pages of each lease
        from the store (see the module docstring). False when it cannot be queued now."""
        if not lease_ids or len(lease_ids) > MAX_LEASES:
            return False
        return self._send(encode_read(lease_ids, pages))

    def close(self) -> None:
        self._sock.close()


class CommitInbox:
    """The owner's side: ``drain()`` applies every queued commit through ``commit_many`` (the
    manager's) and keeps each datagram's ``Committed`` for ``take_replies()``, and every reader's
    report through ``reader_copied``. Thread-safe: one lock from taking a datagram until it is
    applied (see the module docstring)."""

    def __init__(self, control_endpoint: str, commit_many, reader_copied) -> None:
        self.path = inbox_path(control_endpoint)
        self.commit_many = commit_many
        self.reader_copied = reader_copied
        # bad: malformed, or applying it failed
        self.counters = {"commit_datagrams": 0, "commit_datagrams_bad": 0, "read_datagrams": 0}
        self._lock = threading.Lock()
        self._replies: list[tuple[str, list[Committed]]] = []
        if os.path.exists(self.path):  # a previous owner's; its senders fall back until this binds
            os.unlink(self.path)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.setblocking(False)
        self._sock.bind(self.path)

    def fileno(self) -> int:
        return self._sock.fileno()

    def drain(self) -> int:
        """Apply every commit queued now; returns how many datagrams were applied."""
        applied = 0
        with self._lock:
            while True:
                try:
                    datagram = self._sock.recv(65536)
                except BlockingIOError:
                    return applied
                if datagram[:len(READ_MAGIC)] == READ_MAGIC:
                    self._apply_read(datagram)
                    continue
                try:
                    endpoint, lease_ids = decode(datagram)
                except (ValueError, UnicodeDecodeError):
                    logger.error("commit inbox: malformed datagram of %d bytes dropped", len(datagram))
                    self.counters["commit_datagrams_bad"] += 1
                    continue
                try:
                    self._replies.append((endpoint, self.commit_many(lease_ids)))
                except Exception:  # a bug: these leases expire; neither draining thread may die of it
                    logger.error("commit inbox: commit of leases %s failed", lease_ids, exc_info=True)
                    self.counters["commit_datagrams_bad"] += 1
                    continue
                self.counters["commit_datagrams"] += 1
                applied += 1

    def _apply_read(self, datagram: bytes) -> None:
        try:
            self.reader_copied(*decode_read(datagram))
        except Exception:  # malformed, or a bug: those pages are offloaded again, as unreported
            logger.error("commit inbox: reader's report of %d bytes not applied", len(datagram), exc_info=True)
            self.counters["commit_datagrams_bad"] += 1
            return
        self.counters["read_datagrams"] += 1

    def take_replies(self) -> list[tuple[str, list[Committed]]]:
        """The ``Committed`` of the commits applied since the last call, per reply endpoint."""
        with self._lock:
            replies, self._replies = self._replies, []
        return replies

    def close(self) -> None:
        self._sock.close()
        if os.path.exists(self.path):
            os.unlink(self.path)
