import os
import stat
import threading
import time

import pytest
import torch
import zmq

from kvlifecycle.control import ControlClient, ControlError, ControlServer, ControlTimeout
from kvlifecycle.manager import KVCacheManager
from kvlifecycle.pool import PoolSpec
from kvlifecycle.rpc import RpcStatus, decode, default_endpoint, encode

from ..helpers import wait_for
from .conftest import kv_owner, run_child
from .kvl_fakes import FakeStore

SPEC = PoolSpec(num_layers=2, num_pages=8, page_size=4, num_heads=1, head_dim=2)


def test_other_process_writes_pages_and_commits_through_the_control_plane():
    # A (this process): pool + manager + ControlServer. B (child): attach, write, commit.
    with kv_owner(SPEC, offload=True) as owner:
        mgr = owner.manager
        a = mgr.allocate(1, list(range(10)))  # 2 full pages + partial
        b = mgr.allocate(2, list(range(100, 104)))
        c = mgr.allocate(3, list(range(200, 204)))
        out = run_child("child_writer.py", {
            "handle": owner.pool.handle(),
            "endpoint": owner.endpoint,
            "leases": [{"lease_id": a.lease_id, "pages": list(a.page_row), "value": 1.5},
                       {"lease_id": b.lease_id, "pages": list(b.page_row), "value": 2.5}],
            "abort": [c.lease_id],
        })
        for page in a.page_row:
            assert torch.all(owner.pool.tensor[:, page] == 1.5)  # B's bytes, seen in A
        assert torch.all(owner.pool.tensor[:, b.page_row[0]] == 2.5)
        assert [it["prefix_len"] for it in out["offload"][str(a.lease_id)]] == [4, 8]
        assert out["aborted"] == [True]

        hit = mgr.lookup(1, list(range(10)))
        assert hit.device_pages == a.page_row[:2]
        s = mgr.stats()
        assert (s["pages_offload_pending"], s["pages_committed"], s["leases_active"]) == (3, 3, 0)
        with ControlClient(owner.endpoint) as client:
            assert client.offload_done([a.page_row[0], a.page_row[1], b.page_row[0]], True) == 3
            assert client.stats()["pages_pinned"] == 0
        mgr.check_invariants()


def test_idle_server_expires_leases():
    clock = [0.0]
    with kv_owner(SPEC, clock=lambda: clock[0], lease_ttl_s=1.0) as owner:
        owner.manager.allocate(1, list(range(8)))
        clock[0] = 5.0
        with ControlClient(owner.endpoint) as client:
            for _ in range(100):
                if client.stats()["leases_active"] == 0:
                    break
                time.sleep(0.02)
            assert client.stats()["leases_expired"] == 1


def test_endpoint_directory_is_private():
    endpoint = default_endpoint("control.sock")
    directory = os.path.dirname(endpoint[len("ipc://"):])
    assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
    os.chmod(directory, 0o755)
    with pytest.raises(PermissionError, match="mode 0700.*chmod 700"):
        ControlServer(None, endpoint)


@pytest.mark.parametrize("frames,status", [
    ([b"", b"not json"], RpcStatus.BAD_REQUEST),
    ([b"not json"], RpcStatus.BAD_REQUEST),  # no delimiter frame
    (encode({"seq": 1, "op": "nope"}), RpcStatus.BAD_REQUEST),
    (encode({"seq": 2, "op": "commit", "args": {"lease_id": "x"}}), RpcStatus.BAD_REQUEST),
    (encode({"seq": 3, "op": "commit", "args": []}), RpcStatus.BAD_REQUEST),
    (encode({"seq": 4, "args": {}}), RpcStatus.BAD_REQUEST),  # no op
    (encode({"seq": 5, "op": "ping"}), RpcStatus.OK),
])
def test_malformed_requests_get_a_status(frames, status):
    with kv_owner(SPEC) as owner:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.connect(owner.endpoint)
        sock.send_multipart(frames)
        assert sock.poll(2000)
        reply, _arrays = decode(sock.recv_multipart()[1:])
        assert RpcStatus(reply["rpc"]) is status, reply
        assert bool(reply.get("error")) is (status is not RpcStatus.OK), reply
        sock.close(0)
        ctx.term()


def test_client_errors_are_clear():
    with kv_owner(SPEC) as owner:
        with ControlClient(owner.endpoint) as client:
            with pytest.raises(ControlError, match="bad_request") as refused:
                client._call("commit_many", {"lease_ids": ["x"]})
            assert refused.value.status is RpcStatus.BAD_REQUEST
            assert [c.items for c in client.commit_many([12345])] == [()]  # unknown lease: nothing to offload
            assert client.abort(12345) is False
    with ControlClient(default_endpoint("control.sock"), timeout_s=0.2) as client:
        with pytest.raises(ControlTimeout, match="no reply"):
            client.ping()


def test_onboard_wait_is_answered_when_the_copy_ends_and_blocks_no_other_request():
    """The consumer of a host hit's pages waits for that copy alone: commits and pings are
    answered meanwhile, and the wait's answer carries the settled cached length and page row."""
    pool = torch.zeros(2, 8, 2, 4, 1, 2)  # the fake store copies into a pool of SPEC's shape
    store = FakeStore(pool, SPEC.page_size)  # FAKE host store: holds the copy in flight on demand
    with kv_owner(SPEC, store=store) as owner:
        mgr = owner.manager
        tokens = list(range(8))
        first = mgr.allocate(1, tokens)
        for key, page in zip(first.keys, first.page_row):  # the host store holds both pages
            store.pages[key] = pool[:, page].clone()
        mgr.abort(first.lease_id)
        other = mgr.allocate(2, list(range(100, 104)))
        store.get_status = "UNREADY"
        [lease] = mgr.onboard_start_many([mgr.allocate(1, tokens, mgr.lookup(1, tokens))])
        assert lease.onboarding and lease.cached_len == 8
        owner.server.wake()  # as kv_lookup_alloc does: the housekeeping thread asks the store; the copy stays in flight
        task = wait_for(lambda: next((t for t, status in list(store.tasks.items()) if status == "UNREADY"), None),
                        5.0, "the housekeeping thread to launch the onboard", interval_s=0.005)

        outcome = []
        with ControlClient(owner.endpoint) as waiter, ControlClient(owner.endpoint) as client:
            thread = threading.Thread(target=lambda: outcome.extend(waiter.onboard_wait([lease.lease_id], 5.0)))
            thread.start()
            time.sleep(0.1)
            assert client.ping() and client.commit_many([other.lease_id])[0].lease_id == other.lease_id
            assert thread.is_alive() and not outcome  # the copy still runs
            store.finish(task, "SUCCESS")
            thread.join(5.0)
        assert [(o.lease_id, o.cached_len, o.page_row) for o in outcome] == [(lease.lease_id, 8, lease.page_row)]
        assert mgr.onboards_in_flight() == 0


def test_wake_has_the_idle_housekeeping_thread_ask_the_store_at_once():
    """kv_lookup_alloc starts an onboard and wakes the housekeeping thread: the store is asked and
    the copy settled on the wake. Idle, the thread waits for a wake or its next lease expiry, 30
    minutes away here (expire_interval_s=3600), so it is seen idle (it found no onboard in flight),
    the store is still asked nothing after the start, and the onboard settles once woken."""
    pool = torch.zeros(2, 8, 2, 4, 1, 2)
    store = FakeStore(pool, SPEC.page_size)  # FAKE host store: copies when asked
    mgr = KVCacheManager(SPEC, "ns", store)
    tokens = list(range(8))
    first = mgr.allocate(1, tokens)
    for key, page in zip(first.keys, first.page_row):  # the host store holds both pages
        store.pages[key] = pool[:, page].clone()
    mgr.abort(first.lease_id)
    idle = threading.Event()  # the housekeeping thread found no onboard in flight: it waits for a wake
    in_flight = mgr.onboards_in_flight

    def onboards_in_flight() -> int:
        n = in_flight()
        if n == 0 and threading.current_thread().name == "kvlifecycle-housekeeping":
            idle.set()
        return n

    mgr.onboards_in_flight = onboards_in_flight
    asked: list[str] = []  # the store's copies, by the thread that asked
    get_async = store.get_async
    store.get_async = lambda *args: asked.append(threading.current_thread().name) or get_async(*args)
    with ControlServer(mgr, default_endpoint("control.sock"), expire_interval_s=3600.0) as server:
        assert idle.wait(10), "the housekeeping thread never looked for onboards"
        [lease] = mgr.onboard_start_many([mgr.allocate(1, tokens, mgr.lookup(1, tokens))])
        assert lease.onboarding and not asked, "the start asks the store nothing"
        time.sleep(0.2)
        assert not asked and mgr.onboard_result(lease.lease_id) is None, "the idle thread acted unwoken"
        server.wake()
        done = wait_for(lambda: mgr.onboard_result(lease.lease_id), 10, "the woken thread to settle the onboard",
                        interval_s=0.001)
        assert asked == ["kvlifecycle-housekeeping"], asked  # the woken thread asked the store, once
        assert done.onboarded and done.cached_len == 8


def test_onboard_wait_for_a_lease_without_an_onboard_or_a_gone_one_is_answered_at_once():
    with kv_owner(SPEC) as owner:
        lease = owner.manager.allocate(1, list(range(6)))
        with ControlClient(owner.endpoint) as client:
            settled, gone = client.onboard_wait([lease.lease_id, 999], timeout_s=1.0)
        assert (settled.cached_len, settled.page_row) == (0, lease.page_row)
        assert gone.cached_len is None and "999" in gone.error


def test_offload_worker_commits_a_batch_in_one_round_trip_then_offloads_off_the_caller(pool):
    """kv_offload commits a batch in one control round trip before it answers (the user's next
    request then finds the pages with no wait), and hands the pages to put to the worker thread,
    which puts and reaps them while the caller goes on."""
    from kvlifecycle.offload_worker import OffloadWorker
    from kvlifecycle.stats_keys import OFFLOAD_STATS
    store = FakeStore(pool.tensor, SPEC.page_size)
    with kv_owner(SPEC, store=store) as owner:
        mgr = owner.manager
        histories = {user: list(range(100 * user, 100 * user + 8)) for user in (1, 2, 3)}
        leases = {user: mgr.onboard(mgr.allocate(user, h, mgr.lookup(user, h))) for user, h in histories.items()}
        commits: list[int] = []
        release = threading.Event()

        with ControlClient(owner.endpoint) as client:
            worker = OffloadWorker(client, store, page_bytes=1, page_size=SPEC.page_size,
                                   before_put=lambda: release.wait(5),  # holds the thread before its puts
                                   on_commit=lambda seconds, n: commits.append(n))
            worker.start()
            committed = worker.commit([leases[user].lease_id for user in (1, 2, 3)])
            assert commits == [3] and [len(c.items) for c in committed] == [2, 2, 2]
            # user 1's next request finds its pages at once, though none is offloaded yet
            assert mgr.lookup(1, histories[1] + [7, 7, 7, 7]).device_tokens == 8
            assert mgr.stats()["pages_offload_pending"] == 6
            worker.submit([(c.namespace, histories[user], c.items) for user, c in zip((1, 2, 3), committed)])
            release.set()
            assert worker.stop(flush_timeout_s=5.0) == 0
            assert set(worker.stats()) == set(OFFLOAD_STATS)  # the names triton_metrics publishes
        assert mgr.stats()["commits"] == 3
        assert mgr.stats()["pages_offload_pending"] == 0  # every put reaped and reported
        assert len(store.pages) == 6  # two full pages per history reached the host store
        mgr.check_invariants()


def test_an_announced_commit_is_applied_before_the_owners_next_lookup_and_its_pages_are_put(pool):
    """kv_offload announces a batch's commit as one datagram (no round trip) and answers; the
    owner applies what is queued before each lookup (drain_commits), so the user's next request
    finds the pages; the owner's reply reaches the worker, which puts them."""
    from kvlifecycle.offload_worker import OffloadWorker
    store = FakeStore(pool.tensor, SPEC.page_size)
    with kv_owner(SPEC, store=store) as owner:
        mgr = owner.manager
        histories = {user: list(range(100 * user, 100 * user + 8)) for user in (1, 2, 3)}
        leases = {user: mgr.onboard(mgr.allocate(user, h, mgr.lookup(user, h))) for user, h in histories.items()}
        with ControlClient(owner.endpoint) as client:
            worker = OffloadWorker(client, store, page_bytes=1, page_size=SPEC.page_size)
            worker.start()
            pages = worker.launch([leases[user].lease_id for user in (1, 2, 3)], [histories[u] for u in (1, 2, 3)])
            assert pages is None  # announced: the owner tells the worker which pages to put
            owner.server.drain_commits()  # what kv_lookup_alloc does before its lookup
            assert mgr.lookup(1, histories[1] + [7, 7, 7, 7]).device_tokens == 8
            wait_for(lambda: len(store.pages) == 6, timeout_s=5, what="the announced commits' pages put")
            assert worker.stop(flush_timeout_s=5.0) == 0
            stats = worker.stats()
            assert stats["commits_announced"] == 1 and stats["commits_round_trip"] == 0
            assert stats["commit_replies_unmatched"] == 0 and stats["offload_queue_depth"] == 0
        assert mgr.stats()["commits"] == 3 and mgr.stats()["pages_offload_pending"] == 0
        assert owner.server.commits.counters["commit_datagrams"] == 1
        mgr.check_invariants()


def test_a_commit_the_inbox_cannot_take_is_a_round_trip(pool):
    """No inbox (an owner not started yet, or one that restarted and has not bound it): the
    worker commits with a round trip before launch returns, never unannounced."""
    from kvlifecycle.offload_worker import OffloadWorker
    store = FakeStore(pool.tensor, SPEC.page_size)
    with kv_owner(SPEC, store=store) as owner:
        mgr = owner.manager
        history = list(range(8))
        lease = mgr.onboard(mgr.allocate(1, history, mgr.lookup(1, history)))
        os.unlink(owner.server.commits.path)
        with ControlClient(owner.endpoint) as client:
            worker = OffloadWorker(client, store, page_bytes=1, page_size=SPEC.page_size)
            worker.start()
            assert worker.launch([lease.lease_id], [history]) == [2]  # committed: 2 full pages to put
            assert mgr.lookup(1, history + [7, 7, 7, 7]).device_tokens == 8  # no drain needed
            assert worker.stop(flush_timeout_s=5.0) == 0
            assert worker.stats()["commits_round_trip"] == 1 and worker.stats()["commits_announced"] == 0
        assert len(store.pages) == 2 and mgr.stats()["pages_offload_pending"] == 0
        mgr.check_invariants()


def test_a_malformed_commit_datagram_is_dropped_and_counted():
    import socket
    from kvlifecycle.commit_channel import decode as decode_commit, encode as encode_commit
    assert decode_commit(encode_commit("ipc:///x/y", [3, -1, 2**40])) == ("ipc:///x/y", [3, -1, 2**40])
    with kv_owner(SPEC) as owner:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.sendto(b"garbage!", owner.server.commits.path)
        sock.sendto(encode_commit("not an endpoint", [12345]), owner.server.commits.path)  # unknown lease
        sock.close()
        wait_for(lambda: owner.server.commits.counters["commit_datagrams_bad"] == 1, timeout_s=5,
                 what="the bad datagram counted")
        wait_for(lambda: owner.server.commits.counters["commit_datagrams"] == 1, timeout_s=5,
                 what="the datagram naming a bad endpoint applied")
        with ControlClient(owner.endpoint) as client:
            assert client.ping()  # the control thread goes on


def test_a_readers_report_is_applied_in_order_and_a_malformed_one_is_counted():
    """hstu_compute's report of the pages it copied shares the commit inbox: applied in the
    order sent (before the commit kv_offload sends after it); a malformed one is dropped."""
    import socket
    from kvlifecycle.commit_channel import CommitSender, decode_read, encode_read
    assert decode_read(encode_read([3, 2**40], [5, 0])) == ([3, 2**40], [5, 0])
    with pytest.raises(ValueError, match="read datagram"):
        decode_read(encode_read([3], [5])[:-1])
    with kv_owner(SPEC) as owner:
        applied = []
        owner.server.commits.reader_copied = lambda ids, pages: applied.append((ids, pages))
        sender = CommitSender(owner.endpoint, reply_endpoint="")
        assert sender.report_read([7, 8], [2, 1]) and sender.report_read([9], [4])
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.sendto(encode_read([1], [1])[:-3], owner.server.commits.path)
        sock.close()
        sender.close()
        wait_for(lambda: owner.server.commits.counters["read_datagrams"] == 2
                 and owner.server.commits.counters["commit_datagrams_bad"] == 1, timeout_s=5,
                 what="both reports applied and the malformed one counted")
        assert applied == [([7, 8], [2, 1]), ([9], [4])]


def test_a_stop_waits_briefly_for_replies_an_owner_that_stopped_never_sends(tmp_path):
    """Announced commits whose owner stopped before replying (its inbox took the datagram and
    never answered) hold the worker's stop for REPLY_WAIT_ON_STOP_S, not its flush timeout."""
    import socket
    from kvlifecycle.commit_channel import inbox_path
    from kvlifecycle.offload_worker import REPLY_WAIT_ON_STOP_S, OffloadWorker
    endpoint = default_endpoint("control.sock")
    silent_inbox = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    silent_inbox.bind(inbox_path(endpoint))  # takes datagrams, applies none: an owner gone quiet
    try:
        with ControlClient(endpoint, timeout_s=0.5) as client:
            worker = OffloadWorker(client, None, page_bytes=1, page_size=SPEC.page_size)
            worker.start()
            assert worker.launch([11, 12], [list(range(8)), list(range(8))]) is None  # announced
            assert worker.stats()["offload_queue_depth"] >= 1  # announced, not put yet: counted as queued
            started = time.monotonic()
            assert worker.stop(flush_timeout_s=60.0) == 0
            assert time.monotonic() - started < REPLY_WAIT_ON_STOP_S + 1.0
            assert worker.stats()["commit_replies_unmatched"] == 2  # the token ids given up on
    finally:
        silent_inbox.close()
