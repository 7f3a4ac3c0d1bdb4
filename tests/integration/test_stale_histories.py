"""Stale and truncated histories, served by a real tritonserver, against both public models.

A user's history is not only ever appended to: it may come back cut shorter, with its last
event's item or action changed, with an event in the middle changed, or another user may send
exactly the same history. Pages are content-addressed (`kvlifecycle.hashing`: a page's key
covers every token before it), so such a request may reuse exactly the full pages it shares,
token for token, with a history served before, and must compute everything after them.

Each test serves one base history, then each changed history (`VARIANTS`), and checks, for
`hstu_ranking` (the ensemble) and `hstu_monolithic` (the baseline, its own pool):

- every answer equals the float32 reference scorer's for exactly that request's history and
  candidates (shape first, then every value, within the CPU fp32 tolerance);
- every changed history's reference scores differ from the base history's by more than that
  tolerance, so an answer computed from the base's stale pages could not pass;
- the KV counters (hstu_kv_lookups_total, hstu_kv_cached_tokens_total,
  hstu_kv_onboarded_pages_total) moved by exactly what the shared full pages allow: a stale page
  reused would add cached tokens, a page lost would take some away; from the host tier, the
  ensemble's hstu_kv_offloaded_pages_total moved by the full pages each request computed, never by
  a page it onboarded (the store holds those already).

On the device tier the base's pages are still in the pool; on the host tier
(`test_changed_histories_from_the_host_tier`) every base was offloaded to the host store and
pushed out of a small device pool (`POOL_PAGES`) before its changed history came: each changed
history is a host hit that onboards exactly its shared pages.

One server (host store + tritonserver, both models) for the whole module; nothing else uses it,
so the counters move only by what these tests send (`Sender` counts every request per model).

Seen failing (in a scratch copy of the tree): a page chain that ignores the tokens fails all four
tests; `PrefixKeys` reusing a user's last keys whenever the full-page count is the same fails all
four (the host tier through the base served again after its changed history); a host store
that ignores the tokens when it matches and copies fails all four.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import pytest

from compute import history_tokens
from compute.reference import default_tolerance
from deploy.client import RankingClient
from deploy.launcher import Server
from deploy.runtime.schema import COMPUTE, ENSEMBLE, LOOKUP, MONOLITHIC, OFFLOAD, RankingRequest
from kvlifecycle.control import ControlClient
from kvlifecycle.manager import MIN_HOST_PAGES
from tests.conftest import start_server
from tests.helpers import metric, wait_for

pytestmark = pytest.mark.integration

POOL_PAGES = 40  # pages of each model's device pool: the device tests' pages fit, three fillers push them all out
OWNER = {ENSEMBLE: LOOKUP, MONOLITHIC: MONOLITHIC}  # the `model` label of each model's KV series
MODELS = [ENSEMBLE, MONOLITHIC]
CANDIDATES = 8
PUBLISH_WAIT_S = 1.5  # more than the models' metrics interval (METRICS_INTERVAL_S, deploy/runtime/triton_metrics.py)


@dataclass(frozen=True)
class Variant:
    """A changed history: `change(items, actions)` gives it from the base's, and it shares its
    first `shared` full pages (token for token) with the base; `other_user`: sent by another user."""

    name: str
    change: Callable[[list[int], list[int], "Geometry"], tuple[list[int], list[int]]]
    shared: int
    other_user: bool = False


@dataclass(frozen=True)
class Geometry:
    """The model's page geometry: a history event is two tokens (item, action)."""

    page_size: int  # tokens per page
    item_vocab: int
    action_vocab: int

    @property
    def events_per_page(self) -> int:
        return self.page_size // 2

    @property
    def base_events(self) -> int:
        """12 full pages and half a page: the base history has a partial last page."""
        return 12 * self.events_per_page + self.events_per_page // 2


def _other_item(item: int, g: Geometry) -> int:
    return item % (g.item_vocab - 1) + 1  # another valid item id (1..item_vocab-1)


def _other_action(action: int, g: Geometry) -> int:
    return (action + 1) % g.action_vocab


def _cut(events: Callable[[Geometry], int]):
    return lambda items, actions, g: (items[:events(g)], actions[:events(g)])


def _item_changed_at(index: Callable[[Geometry], int], keep: Callable[[Geometry], int] | None = None):
    def change(items, actions, g):
        n = keep(g) if keep else len(items)
        items, actions = items[:n], actions[:n]
        i = index(g) if index(g) >= 0 else n + index(g)
        return items[:i] + [_other_item(items[i], g)] + items[i + 1:], actions
    return change


def _action_changed_at(index: Callable[[Geometry], int], keep: Callable[[Geometry], int] | None = None):
    def change(items, actions, g):
        n = keep(g) if keep else len(items)
        items, actions = items[:n], actions[:n]
        i = index(g) if index(g) >= 0 else n + index(g)
        return items, actions[:i] + [_other_action(actions[i], g)] + actions[i + 1:]
    return change


def _aligned(g: Geometry) -> int:
    return 12 * g.events_per_page  # the base cut to its 12 full pages


# With 16 events a page (32 tokens), the base is 200 events: 12 full pages and 8 events more.
VARIANTS = [
    Variant("cut by 3 events, inside the partial last page", _cut(lambda g: g.base_events - 3), 12),
    Variant("cut by 10 events (less than a page), across a page boundary", _cut(lambda g: g.base_events - 10), 11),
    Variant("cut to a page boundary: every page cached, no history token to compute", _cut(_aligned), 12),
    Variant("cut by 6 pages and more", _cut(lambda g: g.base_events - 6 * g.events_per_page - 4), 6),
    Variant("last event's item changed (in the partial page)", _item_changed_at(lambda g: -1), 12),
    Variant("last event's action changed (in the partial page)", _action_changed_at(lambda g: -1), 12),
    Variant("page-aligned history, last event's item changed (its last full page)",
            _item_changed_at(lambda g: -1, keep=_aligned), 11),
    Variant("page-aligned history, last event's action changed (its last full page)",
            _action_changed_at(lambda g: -1, keep=_aligned), 11),
    Variant("a middle event's item changed (page 5)", _item_changed_at(lambda g: 5 * g.events_per_page + 10), 5),
    Variant("a middle event's action changed (page 8)", _action_changed_at(lambda g: 8 * g.events_per_page + 3), 8),
    Variant("another user, exactly the same history", lambda items, actions, g: (items, actions), 12,
            other_user=True),
]


class Sender:
    """Sends requests to the module's server and counts them per model (each is one KV lookup)."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.sent = {model: 0 for model in MODELS}

    def score(self, model: str, request: RankingRequest) -> np.ndarray:
        with RankingClient(self.server.grpc_url, model=model) as client:
            try:
                return client.score(request)
            finally:
                self.sent[model] += 1

    def counters(self, model: str) -> dict[str, float]:
        """The model's KV counters as its metrics port shows them, once they count every request
        sent to it (the series are published about once a second)."""
        def read() -> dict[str, float] | None:
            c = _kv_counters(self.server, OWNER[model])
            return c if c["device_hit"] + c["host_hit"] + c["miss"] == self.sent[model] else None

        what = lambda: f"{model}'s lookups to count the {self.sent[model]} requests sent to it: {_kv_counters(self.server, OWNER[model])}"  # noqa: E731
        counted = wait_for(read, 30, what)
        if model != ENSEMBLE:  # no offload count to wait for (`_kv_counters`)
            return counted
        # kv_offload counts a put once it is reaped (`wait_offloaded`) and publishes the count within
        # a metrics interval: read again after one, or a late put would count in the next delta
        time.sleep(PUBLISH_WAIT_S)
        return wait_for(read, 30, what)

    def wait_counted(self, model: str, before: dict[str, float], expected: dict[str, float]) -> None:
        """The counters moved by exactly `expected` since `before` (waits for the metrics port)."""
        moved = lambda: {k: _kv_counters(self.server, OWNER[model])[k] - before[k] for k in expected}  # noqa: E731
        wait_for(lambda: moved() == expected, 30,
                 lambda: f"{model}'s KV counters to move by {expected}; moved {moved()}")

    def wait_offloaded(self, model: str) -> None:
        """Every committed page of `model` is in the host store and unpinned. hstu_monolithic
        offloads and reaps before it answers; the ensemble's kv_offload after, so ask its owner."""
        if model != ENSEMBLE:
            return
        with ControlClient(self.server.settings.control_endpoint, timeout_s=30.0) as control:
            state = lambda: control.stats()  # noqa: E731
            wait_for(lambda: (s := state())["pages_pinned"] == 0 and s["leases_active"] == 0, 60,
                     lambda: f"kv_lookup_alloc's offloads to be reaped: {state()}")


def _kv_counters(server: Server, owner: str) -> dict[str, float]:
    lookups = {o: metric(server, "hstu_kv_lookups_total", model=owner, outcome=o)
               for o in ("device_hit", "host_hit", "miss")}
    # The ensemble's host hits are copied by hstu_compute (host_hit_copy=reader, the default) or by
    # the store for kv_lookup_alloc: either model's count of onboarded pages moves.
    copiers = [owner, COMPUTE] if owner == LOOKUP else [owner]
    return {**lookups, "cached_tokens": metric(server, "hstu_kv_cached_tokens_total", model=owner),
            "onboarded_pages": sum(metric(server, "hstu_kv_onboarded_pages_total", model=m) for m in copiers),
            # hstu_monolithic offloads within its call and publishes no such series
            **({"offloaded_pages": metric(server, "hstu_kv_offloaded_pages_total", model=OFFLOAD)} if owner == LOOKUP else {})}


@pytest.fixture(scope="module")
def stale_server(tmp_path_factory):
    srv = start_server(tmp_path_factory.mktemp("stale"), pool_pages=POOL_PAGES)
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def sender(stale_server: Server) -> Sender:
    return Sender(stale_server)


@pytest.fixture(scope="module")
def geometry(reference) -> Geometry:
    c = reference.config
    return Geometry(c.page_size, c.item_vocab, c.action_vocab)


def base_request(user_id: int, seed: list[int], g: Geometry, events: int | None = None) -> RankingRequest:
    rng = np.random.default_rng(seed)
    n = g.base_events if events is None else events
    return RankingRequest(user_id, rng.integers(1, g.item_vocab, n).tolist(),
                          rng.integers(0, g.action_vocab, n).tolist(),
                          rng.integers(1, g.item_vocab, CANDIDATES).tolist())


def changed(base: RankingRequest, variant: Variant, g: Geometry, other_user_id: int) -> RankingRequest:
    items, actions = variant.change(list(base.item_ids), list(base.action_ids), g)
    return RankingRequest(other_user_id if variant.other_user else base.user_id, items, actions,
                          list(base.candidate_ids))


def shared_full_pages(a: RankingRequest, b: RankingRequest, g: Geometry, config) -> int:
    """Leading full pages of `a`'s tokens equal, token for token, to `b`'s."""
    ta = history_tokens(a.item_ids, a.action_ids, config).numpy()
    tb = history_tokens(b.item_ids, b.action_ids, config).numpy()
    S, shared = g.page_size, 0
    while (shared + 1) * S <= min(ta.size, tb.size) and np.array_equal(ta[shared * S:(shared + 1) * S],
                                                                         tb[shared * S:(shared + 1) * S]):
        shared += 1
    return shared


def expected_scores(reference, r: RankingRequest) -> np.ndarray:
    return reference.score(r.user_id, r.item_ids, r.action_ids, r.candidate_ids)


def assert_reference(served, reference, r: RankingRequest, what: str) -> None:
    """`served` has the reference's shape for `r` (shape first: a broadcast would hide a wrong
    one), and every score within the fp32 tolerance."""
    want = expected_scores(reference, r)
    served = np.asarray(served)
    assert served.shape == want.shape, f"{what}: scores of shape {served.shape}, the reference's {want.shape}"
    diff = float(np.abs(served - want).max())
    assert diff <= default_tolerance(reference.config), f"{what}: max abs diff {diff:.2e} vs the reference"


def check_variants_discriminate(reference, base: RankingRequest, variants: list[tuple[Variant, RankingRequest]],
                                g: Geometry) -> None:
    """The test's own construction: each variant shares the full pages it says with the base, and
    every changed history's reference scores (same candidates) move by more than the tolerance."""
    tolerance = default_tolerance(reference.config)
    base_scores = expected_scores(reference, base)
    for v, r in variants:
        assert shared_full_pages(r, base, g, reference.config) == v.shared, v.name
        if not v.other_user:
            moved = float(np.abs(expected_scores(reference, r) - base_scores).max())
            assert moved > tolerance, f"{v.name}: the change moves the reference scores by only {moved:.2e}"


@pytest.mark.parametrize("model", MODELS)
def test_changed_histories_on_the_device(model: str, sender: Sender, reference, geometry: Geometry) -> None:
    """One user's base history, then each changed history with the base served again in between,
    all while the base's pages are in the device pool: each answer equals the reference for its
    own history, and each request reused exactly the full pages it shares with the base."""
    g, S = geometry, geometry.page_size
    tag = MODELS.index(model)
    base = base_request(10_000 + 100 * tag, [35, 2, tag], g)
    variants = [(v, changed(base, v, g, other_user_id=base.user_id + 1)) for v in VARIANTS]
    check_variants_discriminate(reference, base, variants, g)
    before = sender.counters(model)

    assert_reference(sender.score(model, base), reference, base, f"{model} base")
    for v, r in variants:
        assert_reference(sender.score(model, r), reference, r, f"{model}, {v.name}")
        assert_reference(sender.score(model, base), reference, base, f"{model}, the base again after: {v.name}")

    full = len(base.item_ids) * 2 // S
    n = len(variants)
    sender.wait_counted(model, before, {
        "miss": 1, "device_hit": 2 * n, "host_hit": 0, "onboarded_pages": 0,
        "cached_tokens": S * (n * full + sum(v.shared for v, _ in variants))})


@pytest.mark.parametrize("model", MODELS)
def test_changed_histories_from_the_host_tier(model: str, sender: Sender, reference, geometry: Geometry) -> None:
    """A base history per changed history (each user its own), offloaded to the host store and
    pushed out of the device pool by fresh users' histories; then each changed history: it
    onboards from the host exactly the full pages it shares with its base, never a stale one,
    and its answer equals the reference for its own history. Then its base again, which must
    not be served the changed history's pages, now on the device."""
    g, S = geometry, geometry.page_size
    tag = MODELS.index(model)
    bases = [base_request(20_000 + 100 * tag + 2 * i, [35, 3, tag, i], g) for i in range(len(VARIANTS))]
    variants = [(v, changed(b, v, g, other_user_id=b.user_id + 1)) for v, b in zip(VARIANTS, bases)]
    for b, (v, r) in zip(bases, variants):
        check_variants_discriminate(reference, b, [(v, r)], g)

    for i, b in enumerate(bases):
        assert_reference(sender.score(model, b), reference, b, f"{model} base {i}")
    sender.wait_offloaded(model)
    filler_events = 16 * g.events_per_page  # 16 pages each
    for i in range(math.ceil(POOL_PAGES / 16) + 1):  # more fresh pages than the pool holds: every base page leaves it
        filler = base_request(30_000 + 100 * tag + i, [35, 4, tag, i], g, events=filler_events)
        assert_reference(sender.score(model, filler), reference, filler, f"{model} filler {i}")
        sender.wait_offloaded(model)
    before = sender.counters(model)

    expected = {"miss": 0, "device_hit": 0, "host_hit": 0, "onboarded_pages": 0, "cached_tokens": 0,
                "offloaded_pages": 0}
    for b, (v, r) in zip(bases, variants):
        assert_reference(sender.score(model, r), reference, r, f"{model} from the host tier, {v.name}")
        _count(expected, device=0, onboarded=v.shared, full=len(r.item_ids) * 2 // S, page_size=S)
        # The base again: it finds on the device the pages its changed history onboarded and
        # committed, and must find none of that history's own pages under the base's keys.
        assert_reference(sender.score(model, b), reference, b, f"{model}, the base again after: {v.name}")
        full = len(b.item_ids) * 2 // S
        beyond = full - v.shared  # full pages of the base the device lacks now
        _count(expected, device=v.shared, onboarded=beyond if beyond >= MIN_HOST_PAGES else 0, full=full, page_size=S)

    if model != ENSEMBLE:
        del expected["offloaded_pages"]
    sender.wait_counted(model, before, expected)


def _count(expected: dict[str, float], device: int, onboarded: int, full: int, page_size: int) -> None:
    """Add one lookup of `full` full pages that found `device` of them on the device and onboarded
    `onboarded` from the host store (a serving lookup asks the store only for `MIN_HOST_PAGES` or
    more): the rest are computed and offloaded."""
    outcome = "host_hit" if onboarded else "device_hit" if device else "miss"
    expected[outcome] += 1
    expected["onboarded_pages"] += onboarded
    expected["cached_tokens"] += page_size * (device + onboarded)
    expected["offloaded_pages"] += full - device - onboarded
