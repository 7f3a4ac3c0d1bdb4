"""The names of the KV lifecycle's stats keys, in one place.

The code that counts them (``kvlifecycle.leases``, ``kvlifecycle.manager``,
``kvlifecycle.offload_worker``) and the code that publishes them
(``deploy/runtime/triton_metrics.py``) both use these names, so a key renamed here is renamed
for both, and a published key that no longer exists fails at import instead of silently
publishing nothing.
"""

from __future__ import annotations

__all__ = ["DEVICE_HIT", "HOST_HIT", "MISS", "LOOKUP_OUTCOMES", "lookups_key", "PAGE_GAUGES",
           "LEASE_COUNTERS", "OFFLOAD_STATS", "OWNER_PUBLISHED", "OFFLOAD_PUBLISHED"]

# A lookup's outcome (``LookupResult.outcome``); each is counted as ``lookups_<outcome>``.
DEVICE_HIT = "device_hit"
HOST_HIT = "host_hit"
MISS = "miss"
LOOKUP_OUTCOMES = (DEVICE_HIT, HOST_HIT, MISS)


def lookups_key(outcome: str) -> str:
    """The stats key counting lookups of ``outcome``."""
    assert outcome in LOOKUP_OUTCOMES, f"lookups_key: unknown outcome {outcome!r}; known: {LOOKUP_OUTCOMES}"
    return f"lookups_{outcome}"


# ``LeaseTable.stats()``: the page-state gauges, then the counters (always present, so
# dashboards see zeros; ``LeaseTable`` refuses a counter not listed here).
PAGE_GAUGES = (
    "pages_total", "pages_free", "pages_in_use", "pages_committed", "pages_evictable",
    "pages_pinned", "pages_leased", "pages_offload_pending", "leases_active", "pages_quarantined",
)
LEASE_COUNTERS = (
    *(lookups_key(outcome) for outcome in LOOKUP_OUTCOMES), "cached_tokens_served",
    "allocations", "pool_exhausted", "evictions", "commits", "committed_pages",
    "duplicate_pages", "commit_unknown_lease", "aborts", "leases_expired", "onboarded_pages",
    "onboard_failed_pages", "onboard_misses", "quarantined_pages", "store_errors",
    "store_timeouts", "offloads_ok", "offloads_failed", "offload_pins_expired",
    "offload_done_unknown", "uncommitted_prefix_lookups", "pool_waits", "host_filtered_lookups",
    "onboard_reader_pages",
)

# ``OffloadWorker.stats()`` (with a store: ``Offloader`` counters and the store's errors).
OFFLOAD_STATS = (
    "offload_queue_depth", "offloaded_pages", "offloaded_bytes", "puts", "puts_ok", "puts_failed",
    "submit_errors", "reaps", "reap_latency_s_sum", "store_errors",
    "commits_announced", "commits_round_trip", "commit_replies_unmatched",
)

# What Triton publishes: the cache owners (kv_lookup_alloc, hstu_monolithic) and kv_offload.
OWNER_PUBLISHED = (
    *(lookups_key(outcome) for outcome in LOOKUP_OUTCOMES), "cached_tokens_served", "onboarded_pages",
    "pages_free", "pages_in_use", "pages_pinned", "pages_leased", "store_errors",
    "uncommitted_prefix_lookups", "pool_waits", "pool_exhausted", "host_filtered_lookups",
)
OFFLOAD_PUBLISHED = (
    "offload_queue_depth", "offloaded_pages", "offloaded_bytes", "reap_latency_s_sum", "reaps", "store_errors",
    "commits_announced", "commits_round_trip",
)

assert set(OWNER_PUBLISHED) <= set(PAGE_GAUGES) | set(LEASE_COUNTERS), "an owner key is published but never counted"
assert set(OFFLOAD_PUBLISHED) <= set(OFFLOAD_STATS), "an offload key is published but never counted"
