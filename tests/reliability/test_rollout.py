"""Rolling out a new hstu_compute version under load: KV the old weights computed is never read
by the new ones.

A server of its own (explicit model control) serves a test repository whose hstu_compute has
version 1 (the shipped weights). Version 2 (other weights: seed 1, built here) appears as
`hstu_compute/2` while 8 clients send a growing history per user, and the test loads it through
Triton's repository API. Checked:
- every response equals the reference scorer of version 1 or of version 2 (a response mixing
  version-1 KV with version-2 weights equals neither); every request sent after the load
  returned equals version 2's; no request fails (one in flight across the switch is answered
  with a retryable error and resent by the client);
- a user's first request after the rollout finds nothing on the device (version 1's pages are
  never read), and its repeat is a device hit (version 2's KV is cached).
"""
from __future__ import annotations

import json
import os
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from compute import HSTUConfig
from compute.config import CONFIG_FILENAME
from compute.reference import ReferenceScorer
from deploy.client import RankingClient
from deploy.launcher import build_model
from deploy.runtime.schema import COMPUTE
from tests.conftest import LocalServer, launch_config
from tests.helpers import metric
from tests.reliability.conftest import LOOKUP, REAL_REPOSITORY, TOLERANCE, EndlessLoad, Users, history

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


def matches(reference: ReferenceScorer, request, scores: np.ndarray) -> bool:
    expected = reference.score(request.user_id, request.item_ids, request.action_ids, request.candidate_ids)
    return scores.shape == expected.shape and float(np.abs(scores - expected).max()) <= TOLERANCE


def lookup_outcome(server, client: RankingClient, request) -> str:
    """Serve `request` alone and return the owner's lookup outcome for it."""
    before = {o: metric(server, "hstu_kv_lookups_total", model=LOOKUP, outcome=o)
              for o in ("device_hit", "host_hit", "miss")}
    client.score(request)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # the metrics port refreshes every second
        for outcome, count in before.items():
            if metric(server, "hstu_kv_lookups_total", model=LOOKUP, outcome=outcome) > count:
                return outcome
        time.sleep(0.2)
    raise AssertionError(f"no lookup of user {request.user_id} counted within 10 s")


def test_rollout_under_load_never_serves_old_kv(tmp_path: Path, reference) -> None:
    # No host tier, and a pool that holds the whole load (no eviction): a history cached before
    # the rollout is still on the device after it, so only its namespace keeps it from being read.
    server = LocalServer(launch_config(tmp_path, model_control="explicit", store="none", pool_pages=8192,
                                       model_repository=rollout_repository(tmp_path)))
    build_model(server.settings.model_dir, server.settings.device)
    version_2 = staged_version_2(tmp_path, server.settings.device)
    reference_2 = ReferenceScorer(version_2)
    server.start()
    try:
        old = history(7_000_001, 200)  # cached by version 1 before the load starts
        with RankingClient(server.grpc_url, timeout_s=120) as client:
            assert lookup_outcome(server, client, old) == "miss"
            assert lookup_outcome(server, client, old) == "device_hit"
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

        # The history version 1 cached is still in the pool, but version 2 recomputes it (a
        # miss, and the right scores), then finds its own KV.
        assert json.loads(server.settings.compute_version_path.read_text())["version"] == "2"
        with RankingClient(server.grpc_url, timeout_s=120) as client:
            assert lookup_outcome(server, client, old) == "miss", "version 2 looked up KV cached before the rollout"
            assert lookup_outcome(server, client, old) == "device_hit"
            assert matches(reference_2, old, client.score(old))
    finally:
        server.stop()
