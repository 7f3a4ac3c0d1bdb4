"""Faults: nothing wrong is served, nothing hangs, and every page comes back.

On the session `server`:
- a client that cancels its stream or dies with requests in flight (proven: answers missing at the
  cancel, leases returned by abort or expiry): others are served, leases return;
- two concurrent requests for the same user: both correct (the ensemble and the monolithic).

On `fault_server` (small pool, fault injection):
- hstu_compute raising on one request (a test subclass of the model, `fault_models/`) that shares a
  dynamic batch with good ones: that request fails, its lease is aborted (pages back at once, not
  by expiry), its batch-mates are correct;
- the host store killed mid-load, under the ensemble and under the monolithic: requests keep
  being served correctly (recompute), store errors are counted, and the restarted store is
  reconnected (a new user's pages reach it, and come back as a host hit);
- the host store slow (`tests/slow_store.py`, its copies held until the test lets them go): an
  onboard times out and is recomputed, no hang, and the wait for it is hstu_compute's, not
  kv_lookup_alloc's (the owner launched the copy and answered before the onboard timed out);
  every answer comes while the copy is still held;
- the host store not answering (its matches held): the request is recomputed and answered while
  the store still holds its match;
- the pool held by requests in flight (answered, their commits held: every page LEASED): requests
  that need pages wait for them, then are refused saying the pool is exhausted, never a hang;
  served once the commits land.
"""
from __future__ import annotations

import concurrent.futures
import re
import subprocess
import sys
import time
from dataclasses import dataclass

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from compute import HSTUConfig, fingerprint, history_tokens
from deploy.client import RankingClient, RequestFailed
from deploy.launcher import Server
from deploy.runtime.schema import COMPUTE, ENSEMBLE, MONOLITHIC, OFFLOAD, RankingRequest
from deploy.server_stats import read_model_stats
from kvlifecycle.rpc import TIMEOUTS
from deploy.trace import TraceConfig, generate
from tests.conftest import REPO_ROOT
from tests.helpers import ModelStats, metric, pages_in_store, wait_for
from tests.reliability.conftest import (BLOCKER_EVENTS, FAULT_CANDIDATE, FAULT_POOL_PAGES, KV_OWNER, LOOKUP, MODELS,
                                        SLOW_COMMIT_CANDIDATE, FaultServer, Load,
                                        blocker, check_scores, could_run_alone, evict_from_device, fire_together, held,
                                        history, owner_stats, register_pool, send_in_order, settled_kv_metrics,
                                        store_errors, wait_drained, without_fault_candidate)

pytestmark = pytest.mark.integration


CANCEL_SCRIPT = """
import sys, time, tritonclient.grpc as g
from tests.reliability.conftest import history
client = g.InferenceServerClient(sys.argv[1])
client.start_stream(callback=lambda result, error: None)
for i in range(8):
    inputs = []
    for name, arr in history(int(sys.argv[3]) + i, 800).arrays().items():
        t = g.InferInput(name, list(arr.shape), "INT64"); t.set_data_from_numpy(arr); inputs.append(t)
    client.async_stream_infer(sys.argv[2], inputs)
print("sent", flush=True)
time.sleep(600)
"""


def test_clients_gone_mid_stream_others_served_and_leases_return(server: Server, reference) -> None:
    """One process is SIGKILLed and one client cancels its stream (stop_stream(cancel_requests=True)),
    each with 8 requests in flight; a third client is served meanwhile. In flight, proven: the
    cancelling client had fewer than its 8 answers when it cancelled (sent last, 0.2 s before, behind
    the killed process's 8), and leases came back by abort or expiry, not by commit: requests
    dropped between two steps."""
    before = wait_drained(server)
    others = generate(TraceConfig(num_users=6, num_requests=24, seed=12))
    killed = subprocess.Popen([sys.executable, "-c", CANCEL_SCRIPT, server.grpc_url, ENSEMBLE, "5100"],
                              cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True)
    load = Load(server.grpc_url, others, concurrency=2)
    answered: list[object] = []  # the cancelling stream's answers (scores, not errors)
    try:
        assert killed.stdout.readline().strip() == "sent"
        cancelled = grpcclient.InferenceServerClient(server.grpc_url)
        cancelled.start_stream(callback=lambda result, error: answered.append(result) if error is None else None)
        for i in range(8):
            inputs = []
            for name, arr in history(5000 + i, 800).arrays().items():
                t = grpcclient.InferInput(name, list(arr.shape), "INT64")
                t.set_data_from_numpy(arr)
                inputs.append(t)
            cancelled.async_stream_infer(ENSEMBLE, inputs)
        time.sleep(0.2)
        cancelled.stop_stream(cancel_requests=True)
        answered_at_cancel = len(answered)
        cancelled.close()
    finally:
        killed.kill()
        killed.wait()

    results = load.join()
    for i, outcome in sorted(results.items()):
        assert isinstance(outcome, np.ndarray), f"request {i} of another client failed: {outcome!r}"
        check_scores(reference, others[i], outcome, what=f"request {i} of another client")
    # A lease of a request dropped between two steps returns on expiry (lease_ttl_s = 30 s).
    drained = wait_drained(server, timeout_s=120)
    expired, aborted = (drained[k] - before[k] for k in ("leases_expired", "aborts"))
    print(f"clients gone: {answered_at_cancel} of the cancelled stream's 8 answered before the cancel; "
          f"leases expired {expired}, aborted {aborted}")
    assert answered_at_cancel < 8, "the cancelled stream had every answer before the cancel: nothing was in flight"
    assert 0 < expired + aborted <= 16, (
        f"{expired} leases expired and {aborted} aborted: expected some (at most the 16 requests of the clients "
        "gone) to have held a lease when their client went")
    with RankingClient(server.grpc_url) as client:  # still serving
        check_scores(reference, others[0], client.score(others[0]))


@pytest.mark.parametrize("model", MODELS)
def test_two_concurrent_requests_for_the_same_user_are_both_correct(server: Server, reference, model: str) -> None:
    base = history(6000, 100, seed=4)
    items, actions = list(base.item_ids), list(base.action_ids)
    for round_ in range(8):
        shorter = RankingRequest(6000, list(items), list(actions), base.candidate_ids)
        items += [round_ + 1] * 20  # a page boundary (16 events) falls in between
        actions += [round_ % 16] * 20
        longer = RankingRequest(6000, list(items), list(actions), base.candidate_ids[:5])
        pairs = [shorter, shorter] if round_ % 2 else [shorter, longer]
        for request, outcome in zip(pairs, fire_together(server.grpc_url, pairs, model=model)):
            assert isinstance(outcome, np.ndarray), f"{model} round {round_}: {outcome!r}"
            check_scores(reference, request, outcome, what=f"{model} round {round_}")
    wait_drained(server)


def test_compute_raising_on_one_request_fails_it_alone_and_returns_its_pages(fault_server: FaultServer,
                                                                              reference) -> None:
    """The failing request shares a dynamic batch with good ones of its size: a long request keeps
    hstu_compute busy while a good request, the failing one and four more good ones queue behind
    it, in that order. Triton runs them in queue order; from its batch statistics the failing one
    (third in the queue) cannot have run alone, so it ran with the good one before or after it,
    and hstu_compute's sub-batches (requests of similar size) kept them together. A round whose
    batch sizes leave that open proves nothing and is repeated with new users."""
    shared_rounds = []
    for round_ in range(4):
        before = wait_drained(fault_server)
        compute_before = ModelStats.read(fault_server, COMPUTE)
        long = blocker(1090 + round_, seed=round_)
        good = [history(1000 + 10 * round_ + i, 150, seed=round_) for i in range(5)]
        bad = history(1099, 150, seed=round_)
        bad = RankingRequest(bad.user_id, bad.item_ids, bad.action_ids, [*bad.candidate_ids[:4], FAULT_CANDIDATE])

        outcomes = send_in_order(fault_server, [[long], good[:1], [bad], good[1:]])

        # Triton counts a batch once its execute has returned, which may be after the clients got
        # their answers: wait for the count rather than read it once.
        def counted(before: ModelStats = compute_before) -> ModelStats | None:
            batches = ModelStats.read(fault_server, COMPUTE) - before
            return batches if batches.inferences >= 7 else None

        batches = wait_for(counted, 10, "hstu_compute's 7 inferences counted")
        assert batches.inferences == 7, batches
        failed = outcomes.pop(2)
        assert isinstance(failed, RequestFailed) and "injected fault" in str(failed), repr(failed)
        for request, scores in zip([long, *good], outcomes):
            assert isinstance(scores, np.ndarray), f"user {request.user_id}: {scores!r}"
            check_scores(reference, request, scores, what=f"round {round_} batch-mate of the failed request,")
        after = wait_drained(fault_server)
        assert after["aborts"] > before["aborts"], "the failed request's lease was not aborted"
        assert after["leases_expired"] == before["leases_expired"], "pages came back by expiry, not by abort"
        print(f"round {round_}: hstu_compute batch sizes {dict(batches.batches)}")
        if not could_run_alone(batches.batches, position=2):
            shared_rounds.append(round_)
        if len(shared_rounds) == 2:
            break
    assert len(shared_rounds) == 2, f"the failing request shared a batch provably in rounds {shared_rounds} only"
    settled_kv_metrics(fault_server)  # the metrics port shows the owner's page table ...
    assert metric(fault_server, "hstu_kv_pages", model=LOOKUP, state="leased") == 0  # ... at the same baseline
    assert metric(fault_server, "hstu_kv_pages", model=LOOKUP, state="pinned") == 0


STORE_CLIENTS = {ENSEMBLE: (LOOKUP, OFFLOAD), MONOLITHIC: (MONOLITHIC,)}  # the models whose store errors count


def in_the_store(server: Server, request: RankingRequest) -> bool:
    """Whether the host store holds every full page of `request`'s history (asked directly; both
    models key their pages in the namespace of the server's model folder)."""
    config = HSTUConfig.load(server.settings.model_dir)
    tokens = history_tokens(request.item_ids, request.action_ids, config)
    full = tokens.numel() // config.page_size
    namespace = fingerprint(server.settings.model_dir)
    return full > 0 and pages_in_store(server.settings.store_endpoint, config, tokens, namespace, 10.0) == full


def settled(read, what: str):
    """`read()` once two reads 1.5 s apart agree: the models publish their counters every second,
    so a value read right after an answer may not count it yet."""
    last = None
    for _ in range(20):
        now = read()
        if now == last:
            return now
        last = now
        time.sleep(1.5)
    raise AssertionError(f"{what} kept moving with no request sent: {last}")


@pytest.mark.parametrize("model", MODELS)
def test_store_killed_mid_load_is_served_by_recompute_then_reconnected(fault_server: FaultServer, reference,
                                                                       model: str) -> None:
    tag = MODELS.index(model)  # users of its own per model: the other model's pages are in the store too
    first_user = 2000 + 6000 * tag
    trace = [without_fault_candidate(r) for r in generate(TraceConfig(
        num_users=20, num_requests=60, seed=11 + tag, zipf_a=0.5, initial_events_median=120,
        initial_events_sigma=0.4))]
    errors = lambda: store_errors(fault_server, STORE_CLIENTS[model])  # noqa: E731
    errors_before = errors()

    load = Load(fault_server.grpc_url, trace, concurrency=4, model=model)
    load.wait_done(12)
    fault_server.kill_store()
    try:
        load.wait_done(30)  # served while the store is down
    finally:  # the module's server gets its store back even when this test fails here
        fault_server.start_store()
    results = load.join()

    for i, outcome in sorted(results.items()):
        assert isinstance(outcome, np.ndarray), f"{model} request {i} failed while the store was killed: {outcome!r}"
        check_scores(reference, trace[i], outcome, what=f"{model} request {i}")
    wait_for(lambda: errors() > errors_before, 30,
             f"the store outage to be counted in {model}'s hstu_kv_store_errors_total")

    # Reconnected by itself: a new user's pages reach the restarted store (no test help: the
    # models' store clients re-register the pool when the store answers NO_POOL).
    with RankingClient(fault_server.grpc_url, model=model) as client:
        probes: list[RankingRequest] = []

        def probe_reaches_the_store() -> bool:
            probes.append(history(first_user + len(probes), 300, seed=1))
            check_scores(reference, probes[-1], client.score(probes[-1]), what=f"{model} after the store restart,")
            wait_drained(fault_server)  # the ensemble's offloads reaped (the monolithic's before it answered)
            return in_the_store(fault_server, probes[-1])

        probing = time.monotonic()
        wait_for(probe_reaches_the_store, 180, "an offload to reach the restarted store", interval_s=1.0)
        print(f"{model}, store killed mid-load: {len(probes)} probe request(s) over {time.monotonic() - probing:.1f}s "
              "until an offload reached the restarted store")
        # ... and come back as host hits, with no store errors any more.
        owner = KV_OWNER[model]
        shown = lambda: (metric(fault_server, "hstu_kv_lookups_total", model=owner, outcome="host_hit"),  # noqa: E731
                         metric(fault_server, "hstu_kv_onboarded_pages_total", model=owner), errors())
        hits, onboarded, errors_then = settled(shown, f"{model}'s host hits, onboarded pages and store errors")
        user = probes[-1]
        evict_from_device(client, first_user=first_user + 100)
        check_scores(reference, user, client.score(user), what=f"{model} host hit after the store restart,")
    wait_drained(fault_server)
    wait_for(lambda: shown()[0] > hits and shown()[1] > onboarded, 30,
             lambda: f"a host hit that onboarded pages after the store restart: host hits, onboarded pages and "
                     f"store errors {(hits, onboarded, errors_then)} -> {shown()}")
    assert errors() == errors_then, "store errors still growing after the store came back"


@dataclass
class Slowed:
    """What `next_request_from_a_slowed_store` saw: the owner's stats before the request, once
    kv_lookup_alloc had answered it, and right after its own answer; the store's calls
    (`FaultServer.store_calls`) once `alongside`'s next request was answered (None without one)
    and at the request's answer; the seconds each model spent in execute meanwhile."""
    before: dict[str, int]
    at_lookup_answer: dict[str, int]
    after: dict[str, int]
    calls_at_alongside_answer: list[str] | None
    calls_at_answer: list[str]
    in_model: dict[str, float]


def next_request_from_a_slowed_store(fault_server: FaultServer, reference, user: RankingRequest, evict_from: int,
                                     what: str, hold: str, alongside: RankingRequest | None = None) -> Slowed:
    """Serve `user`, push its pages out of the device pool (the store holds them), restart the
    store with its copies or its matches held (`hold`: "copy" or "match"; see FaultServer) and
    serve the user's next request (two more events) while they are, checking its scores; the
    hold ends after the answers. `alongside` is served after the eviction, so its next request,
    sent once kv_lookup_alloc answered the held one, is a device hit. The store is restarted
    without a hold afterwards."""
    with RankingClient(fault_server.grpc_url, timeout_s=120) as client:
        check_scores(reference, user, client.score(user))
        wait_drained(fault_server)  # its pages are in the store (DRAM, then disk)
        evict_from_device(client, first_user=evict_from)
        if alongside is not None:
            check_scores(reference, alongside, client.score(alongside))
        wait_drained(fault_server)
        fault_server.stop_store()  # the same store contents (disk tier), now held
        fault_server.store_hold = hold
        try:
            with held(fault_server.store_hold_file), RankingClient(fault_server.grpc_url, timeout_s=30) as slowed:
                fault_server.start_store()
                register_pool(fault_server)
                before = owner_stats(fault_server)
                triton_before = read_model_stats(fault_server.http_url)
                lookups = ModelStats.read(fault_server, LOOKUP)
                grown = RankingRequest(user.user_id, user.item_ids + [7, 8], user.action_ids + [1, 2],
                                       user.candidate_ids)
                with concurrent.futures.ThreadPoolExecutor(1) as pool:
                    scored = pool.submit(slowed.score, grown)
                    wait_for(lambda: (ModelStats.read(fault_server, LOOKUP) - lookups).success >= 1 or scored.done(),
                             30, "kv_lookup_alloc to answer the request", interval_s=0.01)
                    at_lookup_answer = owner_stats(fault_server)
                    calls_at_alongside_answer = None
                    if alongside is not None:
                        with RankingClient(fault_server.grpc_url, timeout_s=30) as other:
                            nxt = RankingRequest(alongside.user_id, alongside.item_ids + [7, 8],
                                                 alongside.action_ids + [1, 2], alongside.candidate_ids)
                            check_scores(reference, nxt, other.score(nxt), what=f"{what} alongside,")
                        calls_at_alongside_answer = fault_server.store_calls()
                    check_scores(reference, grown, scored.result(), what=what)
                calls_at_answer = fault_server.store_calls()
                after = owner_stats(fault_server)
                triton_after = read_model_stats(fault_server.http_url)
        finally:  # the hold ended; the store goes (a copy or match it held ends as failed for the owner)
            fault_server.kill_store()
            fault_server.store_hold = None
            fault_server.start_store()
            register_pool(fault_server)
    in_model = {m: (triton_after[m].stages["compute_infer"] - triton_before[m].stages["compute_infer"]).ns / 1e9
                for m in (LOOKUP, COMPUTE)}
    return Slowed(before, at_lookup_answer, after, calls_at_alongside_answer, calls_at_answer, in_model)


def test_slow_store_times_out_and_recomputes_instead_of_hanging(fault_server: FaultServer, reference) -> None:
    """The store's copies are held (by the test) past the onboard wait (rpc.Timeouts.onboard_wait_s,
    2 s): the onboard times out, its pages are quarantined (the copy may still write them) and
    recomputed, and every answer comes while the copy is still held. The owner launched the copy and
    answered before the onboard timed out; hstu_compute waited for it in its execute (every answer
    is returned from execute: docs/ARCHITECTURE.md, "Batching on tritonserver 2.51"), and a device
    hit sent meanwhile is answered too, while the copy is held."""
    run = next_request_from_a_slowed_store(
        fault_server, reference, history(3000, 400, seed=2), evict_from=3100, what="with a slow store,", hold="copy",
        alongside=history(3099, 100, seed=4))
    before, after = run.before, run.after
    assert after["lookups_host_hit"] == before["lookups_host_hit"] + 1, "the slow store did not report a host hit"
    assert after["lookups_device_hit"] == before["lookups_device_hit"] + 1, "the request alongside was no device hit"
    assert after["onboarded_pages"] == before["onboarded_pages"], "pages counted as onboarded from a timed-out get"
    assert "copy start" in run.calls_at_answer, f"the store never started the onboard's copy: {run.calls_at_answer}"
    # Answered while the copy was still held: nothing waited for the copy itself.
    assert "copy done" not in run.calls_at_answer + run.calls_at_alongside_answer, run.calls_at_answer
    # ... but hstu_compute waited for the onboard: it answered after the onboard timed out,
    assert after["store_timeouts"] > before["store_timeouts"], f"no onboard timeout: {before} -> {after}"
    assert after["pages_quarantined"] > 0, "the timed-out copy's pages were not quarantined while it may write"
    # ... while kv_lookup_alloc had answered before that: it launched the copy and did not wait.
    assert run.at_lookup_answer["store_timeouts"] == before["store_timeouts"], (
        "kv_lookup_alloc answered only after the onboard timed out: its execute waited for the store")
    print(f"slow store: host hit, onboard timed out, recomputed, answered while the copy was held; a device hit "
          f"alongside too; seconds in execute: {run.in_model}")
    wait_drained(fault_server, timeout_s=120)  # quarantined pages return once the store's task ends


def test_a_store_that_stops_answering_never_holds_the_owner(fault_server: FaultServer, reference) -> None:
    """The store's socket thread holds every match (by the test) past a store RPC's timeout
    (rpc.Timeouts.store_rpc_s, 0.5 s). A user whose history only the store holds is served by
    recompute while the store still holds the match, and kv_lookup_alloc's execute never waits for
    the store: the store is asked from its control thread, and hstu_compute waits for that answer
    (or its timeout) alone."""
    run = next_request_from_a_slowed_store(
        fault_server, reference, history(3200, 400, seed=3), evict_from=3300,
        what="with a store that stopped answering,", hold="match")
    before, after = run.before, run.after
    assert after["lookups_miss"] == before["lookups_miss"] + 1, f"expected a miss: {before} -> {after}"
    assert after["onboarded_pages"] == before["onboarded_pages"]
    assert "match start" in run.calls_at_answer, f"the store was never asked: {run.calls_at_answer}"
    assert "match done" not in run.calls_at_answer, "answered only once the store answered"
    # A store RPC to a store holding its matches lasts its whole timeout (0.5 s); kv_lookup_alloc
    # spent less than half of one in execute (a few ms), so its execute made none: the control
    # thread asked. (A duration Triton measured, bounded by what the defect costs at least.)
    assert run.in_model[LOOKUP] < TIMEOUTS.store_rpc_s / 2, f"seconds in each execute: {run.in_model}"
    print(f"store not answering: recomputed while the store held its match; seconds in execute: {run.in_model}")
    wait_drained(fault_server, timeout_s=120)


def test_a_prefix_still_being_written_is_recomputed_without_waiting(fault_server: FaultServer, reference) -> None:
    """kv_offload commits before it answers; here it commits one request only once the test lets
    it (fault_models/kv_offload_model.py), as when a user's two requests are in flight at once. The
    user's next request finds those pages still being written: it is answered while that commit is
    still held (so it did not wait for it), computes them itself (right scores, counted as an
    uncommitted-prefix lookup), and the late commit still lands without a leak."""
    slow = history(3400, 300, seed=7)
    slow = RankingRequest(slow.user_id, slow.item_ids, slow.action_ids, [*slow.candidate_ids[:4], SLOW_COMMIT_CANDIDATE])

    def grown(r: RankingRequest) -> RankingRequest:
        return RankingRequest(r.user_id, r.item_ids + [7, 8], r.action_ids + [1, 2], without_fault_candidate(r).candidate_ids)

    with RankingClient(fault_server.grpc_url, timeout_s=30) as client:
        wait_drained(fault_server)
        before = owner_stats(fault_server)
        with fault_server.commits_held():
            check_scores(reference, slow, client.score(slow))  # answered; its commit is held
            check_scores(reference, grown(slow), client.score(grown(slow)), what="behind a held commit,")
            during = owner_stats(fault_server)
    assert during["uncommitted_prefix_lookups"] == before["uncommitted_prefix_lookups"] + 1, f"{before} -> {during}"
    assert during["lookups_device_hit"] == before["lookups_device_hit"], "its prefix was not committed: recomputed"
    # Answered while the first request's commit was held: its lease still active, only its own commit made.
    assert (during["leases_active"], during["commits"] - before["commits"]) == (1, 1), during
    after = wait_drained(fault_server, timeout_s=30)  # the late commit lands; every page returns
    assert after["commits"] == before["commits"] + 2, f"the held commit never landed: {before} -> {after}"
    print("late commit: the user's next request recomputed its prefix while the commit was held")


def with_slow_commit(request: RankingRequest) -> RankingRequest:
    """`request` with SLOW_COMMIT_CANDIDATE as its last candidate: kv_offload commits it only once
    `commits_held()` ends."""
    return RankingRequest(request.user_id, request.item_ids, request.action_ids,
                          [*request.candidate_ids[:-1], SLOW_COMMIT_CANDIDATE])


def test_pool_pressure_from_long_requests_in_flight_waits_then_errors_clearly_never_hangs(fault_server: FaultServer,
                                                                                         reference) -> None:
    """The pool (384 pages) is held by requests in flight: a max-length request (128 pages) and
    four of 1024 events (64 pages each), answered but with their commits held (`commits_held`), so
    every page is LEASED and none can come back. Two more requests, one max-length and one of 2
    pages, cannot fit: they wait for the held pages (the owner's pool wait, 1 s), then are refused
    saying the pool is exhausted, never a hang. Once the commits land, both are served."""
    wait_drained(fault_server)  # nothing leased or pinned: every other page is free or evictable
    before = owner_stats(fault_server)
    holders = [with_slow_commit(blocker(4099, seed=3)),
               *(with_slow_commit(history(4000 + i, 1024, candidates=8, seed=3)) for i in range(4))]
    refused = [history(4010, BLOCKER_EVENTS, candidates=8, seed=3), history(4011, 32, candidates=8, seed=3)]

    with fault_server.commits_held():
        outcomes = send_in_order(fault_server, [holders, refused])
        during = owner_stats(fault_server)  # after the refusals, before the commits

    for request, outcome in zip(holders, outcomes):
        assert isinstance(outcome, np.ndarray), f"user {request.user_id}, holding pages: {outcome!r}"
        check_scores(reference, request, outcome, what="holding pages,")
    assert during["pages_leased"] == FAULT_POOL_PAGES, f"the holders did not lease the whole pool: {during}"
    for request, outcome in zip(refused, outcomes[len(holders):]):
        assert isinstance(outcome, RequestFailed), (
            f"user {request.user_id} got {outcome!r} from a pool whose every page was leased")
        assert "KV page pool exhausted, retry later" in str(outcome), f"user {request.user_id}: {outcome}"
        leased = re.search(r"(\d+) leased\)", str(outcome))
        assert leased and int(leased.group(1)) == FAULT_POOL_PAGES, f"user {request.user_id}: {outcome}"
    after = wait_drained(fault_server)
    waits, exhausted = (after[k] - before[k] for k in ("pool_waits", "pool_exhausted"))
    print(f"{len(refused)} requests behind {len(holders)} holding all {FAULT_POOL_PAGES} pages: refused; "
          f"pool_waits +{waits}, pool_exhausted +{exhausted}")
    assert exhausted == len(refused), f"pool_exhausted +{exhausted} for {len(refused)} refused requests"
    assert waits >= 1, "refused at once: they would fit once the held pages return, so they wait first"
    with RankingClient(fault_server.grpc_url) as client:  # the commits landed: both fit now
        for request in refused:
            check_scores(reference, request, client.score(request), what="retried,")
