"""Rolling out a new hstu_compute version under load: KV the old weights computed is never read
by the new ones, from the device, the host store or its disk tier, and not after a restart either.

A server of its own (explicit model control, the embedded host store with a disk tier) serves a
test repository whose hstu_compute has version 1 (the shipped weights). Version 2 (other weights:
seed 1, built here) appears as `hstu_compute/2` while 8 clients send a growing history per user,
and the test loads it through Triton's repository API. Checked:
- every response equals the reference scorer of version 1 or of version 2 (a response mixing
  version-1 KV with version-2 weights equals neither); every request sent after the load
  returned equals version 2's; no request fails (one in flight across the switch is answered
  with a retryable error and resent by the client);
- a user cached by version 1 (on the device and in the host store, which the test asks) is a
  miss for version 2, scored as version 2's reference, and its repeat is a device hit;
- after a stop and start with the same disk tier (an empty device pool, a fresh store process),
  users that only version 1 served are misses for version 2 although the disk tier still holds
  their version-1 pages, and are scored as version 2's reference; a user version 2 served before
  the restart is a host hit (the disk tier does serve version 2's own pages).

Seen failing (in a scratch copy of the tree): a host store that ignores the namespace when it
keys pages (kvlifecycle/store: a constant in place of the namespace) fails this test: version-1
pages come back to version 2 from the store as host hits, with scores neither version gives.
"""
from __future__ import annotations

import json
import os
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from compute import HSTUConfig, fingerprint, history_tokens
from compute.config import CONFIG_FILENAME
from compute.reference import ReferenceScorer
from deploy.client import RankingClient
from deploy.launcher import build_model
from deploy.runtime.schema import COMPUTE, RankingRequest
from tests.conftest import LocalServer, launch_config
from tests.helpers import assert_scores_match, pages_in_store
from tests.reliability.conftest import REAL_REPOSITORY, TOLERANCE, EndlessLoad, Users, history, owner_stats, wait_drained

pytestmark = [pytest.mark.integration, pytest.mark.slow]

CONCURRENCY = 8
BEFORE_S = 5.0  # load on version 1 before the rollout
AFTER_S = 5.0  # load on version 2 after the load returned
SETTLE_S = 2.0  # requests sent this soon after the load returned may still be version 1's


def rollout_repository(root: Path) -> Path:
    """The real models (linked), with hstu_compute holding only version 1 (linked)."""
    repository = root / "rollout_repository"
    (repository / COMPUTE).mkdir(parents=True)
    for model in REAL_REPOSITORY.iterdir():
        if model.is_dir() and model.name != COMPUTE:
            (repository / model.name).symlink_to(model)
    (repository / COMPUTE / "config.pbtxt").symlink_to(REAL_REPOSITORY / COMPUTE / "config.pbtxt")
    (repository / COMPUTE / "1").symlink_to(REAL_REPOSITORY / COMPUTE / "1")
    return repository


def staged_version_2(root: Path, device: str) -> Path:
    """A version folder with other weights (seed 1) and its AOTI package, ready to move in."""
    folder = root / "staging" / "2"
    folder.mkdir(parents=True)
    config = HSTUConfig.load(REAL_REPOSITORY / COMPUTE / "1")
    HSTUConfig(**{**json.loads(config.to_json()), "seed": config.seed + 1}).save(folder / CONFIG_FILENAME)
    build_model(folder, device)  # writes the seeded checkpoint, then the package
    (folder / "model.py").symlink_to(REAL_REPOSITORY / COMPUTE / "1" / "model.py")
    return folder


def expected(reference: ReferenceScorer, request) -> np.ndarray:
    return reference.score(request.user_id, request.item_ids, request.action_ids, request.candidate_ids)


def matches(reference: ReferenceScorer, request, scores: np.ndarray) -> bool:
    want = expected(reference, request)
    return scores.shape == want.shape and float(np.abs(scores - want).max()) <= TOLERANCE


def served(server, client: RankingClient, request) -> tuple[str, np.ndarray]:
    """Serve `request` alone; the owner's lookup outcome for it (its page table counters, read
    over the control socket) and the scores."""
    before = owner_stats(server)
    scores = client.score(request)
    after = owner_stats(server)
    moved = [o for o in ("device_hit", "host_hit", "miss") if after[f"lookups_{o}"] > before[f"lookups_{o}"]]
    assert len(moved) == 1, f"user {request.user_id}: lookups moved by {moved}"
    return moved[0], scores


def in_the_store(server, request, namespace: str) -> bool:
    """Whether the host store holds every full page of `request`'s history in `namespace` (asked directly)."""
    config = HSTUConfig.load(server.settings.model_dir)
    tokens = history_tokens(request.item_ids, request.action_ids, config)
    full = tokens.numel() // config.page_size
    return full > 0 and pages_in_store(server.settings.store_endpoint, config, tokens, namespace, 30.0) == full


def grown(request) -> RankingRequest:
    return RankingRequest(request.user_id, request.item_ids + [5, 6], request.action_ids + [3, 4],
                          request.candidate_ids)


def test_rollout_under_load_never_serves_old_kv(tmp_path: Path, reference) -> None:
    # A pool that holds the whole load (no eviction): a history cached before the rollout is
    # still on the device and in the host store after it, so only its namespace keeps it from
    # being read. After the restart, the disk tier alone holds it.
    server = LocalServer(launch_config(tmp_path, model_control="explicit", pool_pages=8192,
                                       store_disk_dir=tmp_path / "disk",
                                       model_repository=rollout_repository(tmp_path)))
    build_model(server.settings.model_dir, server.settings.device)
    version_2 = staged_version_2(tmp_path, server.settings.device)
    reference_2 = ReferenceScorer(version_2)
    namespace_1 = fingerprint(server.settings.model_dir)
    server.start()
    try:
        old = history(7_000_001, 200)  # cached by version 1, served by version 2 before the restart
        kept = [history(7_000_002 + i, 200) for i in range(2)]  # cached by version 1, next served after the restart
        with RankingClient(server.grpc_url, timeout_s=120) as client:
            assert served(server, client, old)[0] == "miss"
            assert served(server, client, old)[0] == "device_hit"
            for r in kept:
                assert_scores_match(client.score(r), expected(reference, r), TOLERANCE, f"version 1, user {r.user_id}")
        wait_drained(server)  # every offload reaped: the store holds their pages
        for r in [old, *kept]:
            assert in_the_store(server, r, namespace_1), f"user {r.user_id}'s version-1 pages are not in the store"
        load = EndlessLoad(server.grpc_url, Users(seed=5), CONCURRENCY)
        time.sleep(BEFORE_S)
        os.rename(version_2, tmp_path / "rollout_repository" / COMPUTE / "2")
        load_v2 = urllib.request.Request(f"http://{server.http_url}/v2/repository/models/{COMPUTE}/load", data=b"{}")
        urllib.request.urlopen(load_v2, timeout=300).read()
        loaded = time.monotonic()
        time.sleep(AFTER_S)
        load.join()

        assert not load.errors, f"{len(load.errors)} failed requests, e.g. {load.errors[:3]}"
        by_version = {1: 0, 2: 0}
        for i, answer in enumerate(load.served):
            sent, request, scores = answer.sent_at, answer.request, answer.scores
            may_be_old = sent < loaded + SETTLE_S
            if may_be_old and matches(reference, request, scores):
                by_version[1] += 1
            elif matches(reference_2, request, scores):
                by_version[2] += 1
            else:
                pytest.fail(f"response {i} (user {request.user_id}, sent {sent - loaded:+.2f}s from the load) "
                            "equals neither version's reference" if may_be_old else
                            f"response {i} (user {request.user_id}) sent {sent - loaded:.2f}s after the load "
                            "returned is not version 2's")
        print(f"rollout: {len(load.served)} responses, {by_version[1]} by version 1 and {by_version[2]} by version 2, "
              f"{load.retried} resent after a retryable error")
        assert by_version[1] > 0 and by_version[2] > 0

        # The history version 1 cached is still in the pool and the store, but version 2
        # recomputes it (a miss, and the right scores), then finds its own KV.
        assert json.loads(server.settings.compute_version_path.read_text())["version"] == "2"
        assert in_the_store(server, old, namespace_1)
        with RankingClient(server.grpc_url, timeout_s=120) as client:
            outcome, scores = served(server, client, old)
            assert outcome == "miss", f"version 2 found KV cached before the rollout ({outcome})"
            assert_scores_match(scores, expected(reference_2, old), TOLERANCE, "version 2, a user version 1 cached")
            outcome, scores = served(server, client, old)
            assert outcome == "device_hit", f"version 2 did not find its own KV on the device ({outcome})"
            assert_scores_match(scores, expected(reference_2, old), TOLERANCE, "version 2 from its own KV")
        wait_drained(server)  # version 2's pages of `old` reach the store

        # A restart with the same disk tier: the device pool is empty, the store a new process.
        server.stop()
        server.start()
        assert json.loads(server.settings.compute_version_path.read_text())["version"] == "2"
        with RankingClient(server.grpc_url, timeout_s=120) as client:
            for r in kept:
                assert in_the_store(server, r, namespace_1), f"user {r.user_id}: the disk tier lost version 1's pages"
                outcome, scores = served(server, client, grown(r))
                assert outcome == "miss", (f"user {r.user_id}: after the restart, version 2 found KV version 1 "
                                           f"cached ({outcome})")
                assert_scores_match(scores, expected(reference_2, grown(r)), TOLERANCE,
                                    f"version 2 after the restart, user {r.user_id} version 1 cached")
            outcome, scores = served(server, client, grown(old))
            assert outcome == "host_hit", f"version 2's own pages of user {old.user_id} did not come back ({outcome})"
            assert_scores_match(scores, expected(reference_2, grown(old)), TOLERANCE,
                                "version 2 after the restart, from its own pages on disk")
    finally:
        server.stop()
