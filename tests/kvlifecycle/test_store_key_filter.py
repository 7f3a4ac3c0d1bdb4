"""The store's published filter of held keys (kvlifecycle/store/key_filter.py): what it says, that
a real store process keeps it right through puts, a restart with the disk tier and a stop, and that
the owner asks the store nothing about a history the filter rules out; a Mooncake store publishes
none."""
from __future__ import annotations

from pathlib import Path
from typing import Iterator

import numpy as np
import pytest

from kvlifecycle.hashing import page_keys
from kvlifecycle.manager import KVCacheManager
from kvlifecycle.pool import PagePool
from kvlifecycle.store import Status
from kvlifecycle.store import key_filter
from kvlifecycle.store.key_filter import KeyFilterReader, KeyFilterWriter, key_filter_path
from kvlifecycle.store.processes import start_store_process

from .store_harness import SPEC, EmbeddedHarness, MooncakeHarness, fill_random, mooncake_skip_reason, slots, tokens


@pytest.fixture(scope="module")
def pool() -> Iterator[PagePool]:
    with PagePool.create(SPEC) as p:
        yield p


def keys_of(seq: np.ndarray, ns: str) -> list[bytes]:
    return page_keys(seq, ns, SPEC.page_size)


@pytest.fixture
def recheck_at_once(monkeypatch):
    """Readers look for a new filter file at every call, not every RECHECK_S."""
    monkeypatch.setattr(key_filter, "RECHECK_S", 0.0)


def test_the_filter_says_which_leading_keys_may_be_held_and_a_rebuild_forgets_evicted_ones(tmp_path):
    path = tmp_path / "store.sock.keys"
    writer = KeyFilterWriter(path, slots=1 << 16)
    reader = KeyFilterReader(path)
    a, b = keys_of(tokens(4, start=1), "ns"), keys_of(tokens(4, start=1000), "ns")
    assert reader.may_hold(a) == 0 and reader.may_hold([]) == 0
    writer.add(a[:3])
    assert reader.may_hold(a) == 3, "the held prefix: a key not held ends it"
    assert reader.may_hold(a[1:] + b) == 2
    writer.rebuild(b)  # a was evicted since
    assert (reader.may_hold(a), reader.may_hold(b)) == (0, 4)
    writer.close()
    assert not path.exists()


def test_without_a_readable_filter_every_key_may_be_held(tmp_path, recheck_at_once):
    """No file (a store not started, or one that publishes none), a file that is not a filter, or a
    tcp:// store (maybe on another host): the owner asks the store, as it did before filters."""
    keys = keys_of(tokens(3), "ns")
    reader = KeyFilterReader(tmp_path / "none.keys")
    assert reader.may_hold(keys) == 3
    (tmp_path / "junk.keys").write_bytes(b"not a filter" * 100)
    assert KeyFilterReader(tmp_path / "junk.keys").may_hold(keys) == 3
    assert key_filter_path("tcp://127.0.0.1:5555") is None
    assert key_filter_path("ipc:///run/x/store.sock") == Path("/run/x/store.sock.keys")


def test_a_reader_follows_a_restarted_store_to_its_new_file(tmp_path, recheck_at_once):
    path = tmp_path / "store.sock.keys"
    keys = keys_of(tokens(2), "ns")
    first = KeyFilterWriter(path, slots=1 << 16)
    first.add(keys)
    reader = KeyFilterReader(path)
    assert reader.may_hold(keys) == 2
    second = KeyFilterWriter(path, slots=1 << 16)  # a new store process: a new, empty file
    assert reader.may_hold(keys) == 0
    second.close()
    assert reader.may_hold(keys) == 2, "no file: every key may be held"


def test_a_store_process_publishes_each_put_before_it_is_done_and_its_disk_pages_after_a_restart(
        pool, tmp_path, recheck_at_once):
    harness = EmbeddedHarness(pool, disk_dir=tmp_path / "disk")
    try:
        store, ns = harness.client(), harness.ns
        assert store.register_pool(pool.handle())  # the store makes its backing (and filter) for the pool
        seq, unseen = tokens(3, start=1), tokens(3, start=5000)
        assert store.may_hold(keys_of(seq, ns)) == 0
        fill_random(pool, [1, 2, 3], seed=7)
        put = store.put_async(seq, slots([1, 2, 3]), ns)
        assert store.wait([put], timeout_s=10)[put] is Status.SUCCESS
        assert store.may_hold(keys_of(seq, ns)) == 3, "a put's keys are published before it is done"
        assert store.may_hold(keys_of(unseen, ns)) == 0
        assert store.may_hold(keys_of(seq, "another-namespace")) == 0

        harness.stop()  # SIGTERM: flushes the disk tier, removes the filter
        assert not key_filter_path(harness.endpoint).exists()
        assert store.may_hold(keys_of(unseen, ns)) == 3, "no store, no filter: every key may be held"
        harness.start()
        assert store.register_pool(pool.handle())
        assert store.may_hold(keys_of(seq, ns)) == 3, "the disk tier's pages are published at the start"
        assert store.may_hold(keys_of(unseen, ns)) == 0
    finally:
        harness.close()


def test_the_owner_does_not_ask_the_store_about_a_history_it_cannot_hold(pool, recheck_at_once):
    """A new user's request is a plain miss: no onboard pages reserved, no store round trip, counted
    as filtered; once the store holds the history, the same lookup is a host-hit candidate."""
    harness = EmbeddedHarness(pool, dedicated=True)
    try:
        store, ns = harness.client(), harness.ns
        assert store.register_pool(pool.handle())
        mgr = KVCacheManager(SPEC, ns, store=store)
        seq = tokens(3, start=1)
        miss = mgr.lookup(1, seq)
        assert (miss.outcome, miss.host_unconfirmed, miss.host_tokens) == ("miss", False, 0)
        assert mgr.stats()["host_filtered_lookups"] == 1 and mgr.stats()["lookups_miss"] == 1

        fill_random(pool, [1, 2, 3], seed=8)
        put = store.put_async(seq, slots([1, 2, 3]), ns)
        assert store.wait([put], timeout_s=10)[put] is Status.SUCCESS
        hit = mgr.lookup(2, seq)
        assert hit.host_unconfirmed and hit.host_tokens == 3 * SPEC.page_size
        assert mgr.stats()["host_filtered_lookups"] == 1
    finally:
        harness.close()


@pytest.mark.skipif(mooncake_skip_reason() is not None, reason=str(mooncake_skip_reason()))
def test_a_mooncake_store_publishes_no_filter_and_every_candidate_is_asked(pool, recheck_at_once):
    """hstu-cluster's tier: other servers' stores put pages into the same Mooncake, so this store
    cannot know what it holds without asking; it publishes nothing, and a stale file left at its
    endpoint by a killed local store is removed at its start."""
    harness = MooncakeHarness(pool, dedicated=True)
    try:
        store = harness.client()
        assert store.register_pool(pool.handle())
        seq = tokens(3, start=1)
        put = store.put_async(seq, slots([1, 2, 3]), harness.ns)
        assert store.wait([put], timeout_s=10)[put] is Status.SUCCESS
        assert not key_filter_path(harness.endpoint).exists()
        assert store.may_hold(keys_of(tokens(3, start=7000), harness.ns)) == 3, "unknown to the store: still asked"
        KeyFilterWriter(key_filter_path(harness.endpoint), slots=1 << 16)  # a file as a killed local store leaves it
        harness.proc.stop()
        harness.proc = start_store_process(harness.endpoint, extra_args=[
            "--backing", "mooncake", "--mooncake-master", harness.master.address, "--mooncake-segment-bytes",
            str(16 << 20)])
        assert not key_filter_path(harness.endpoint).exists(), "the stale filter outlived the store's start"
    finally:
        harness.close()


def test_a_writer_closing_leaves_a_newer_writers_file(tmp_path, recheck_at_once):
    """A restarted store (or a new backing) replaced the file: the old writer's close must not
    remove it, or every client would ask the store about everything until the next restart."""
    path = tmp_path / "store.sock.keys"
    keys = keys_of(tokens(2), "ns")
    old = KeyFilterWriter(path, slots=1 << 16)
    new = KeyFilterWriter(path, slots=1 << 16)
    new.add(keys)
    old.close()
    assert path.exists() and KeyFilterReader(path).may_hold(keys) == 2
    new.close()
    assert not path.exists()
