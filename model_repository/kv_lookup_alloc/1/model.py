"""kv_lookup_alloc: the owner of the KV cache. Per batch: validate -> lookup -> allocate -> launch onboards.

One instance (one process) owns the page table; it creates the device page pool at `initialize`
and publishes its handle for hstu_compute and the host store, and serves the control plane that
kv_offload (commits, offload completions) and hstu_compute (onboard outcomes, aborts) talk to.

Dynamic batching hands `execute` every queued request, and each fixed cost is paid once per
batch: the id ranges of the whole batch are checked in one pass, the history tokens made in one
pass, and the batch goes through the cache together (`KVCacheManager.lookup_many`,
`allocate_many`, `onboard_start_many`, called through the custom ops `torch.ops.kvlifecycle.*`
of `kvlifecycle/ops.py`: one table lock per step), each request hashing only the pages its
history added (`PrefixKeys`). A request with pages beyond its device prefix
(`min_host_pages` or more) is answered at once with them as onboard pages (`onboard_len`),
without asking the host store here: the control plane's thread asks it (one round trip: copy the
ones you hold) and settles each copy when the store reports it done, or as a timeout; pages not
copied are recomputed. hstu_compute asks this process's control plane how that request's onboard
ended before it reads them. With HSTU_HOST_HIT_COPY=reader and a store whose DRAM tier is shared,
the onboard is settled here at once and the plan carries the onboard pages' keys: hstu_compute
copies them from the store's slab itself (docs/ARCHITECTURE.md, "Host hits copied by their reader").

Every request is answered in the list `execute` returns, never through a response sender, and
ids that look corrupted in transit are answered retryable (docs/ARCHITECTURE.md, "Batching on
tritonserver 2.51"). Nothing here waits for a commit:
kv_offload announces its commits before it answers (a datagram this process applies before each
lookup, or its control thread sooner), and a request that finds its prefix still being written
(the same user's previous request still in flight) computes those pages itself. A bad request or
an exhausted pool becomes an error response for that request only and changes no cache state.
"""
import logging
import os
import time

import torch
import triton_python_backend_utils as pb_utils

from compute import HSTUConfig, fingerprint, history_tokens_many
from deploy.runtime import published
from deploy.runtime.compute_plan import NO_KEYS, ComputePlan
from deploy.runtime.cache_owner import open_kv_cache
from kvlifecycle.gil import hand_over_gil_promptly
from deploy.runtime.settings import ServingSettings
from deploy.runtime.triton_io import (BadRequest, RankingInputs, Reply, error_response, output_tensor,
                                     read_ranking_batch)
from deploy.runtime.triton_metrics import KVMetrics, StageTimer, stage_keys
from kvlifecycle.stats_keys import OWNER_PUBLISHED
from kvlifecycle.control import ControlServer
from kvlifecycle.hashing import namespace_tag
from kvlifecycle.store.protocol import keys_to_words
from kvlifecycle import ops

logger = logging.getLogger("kv_lookup_alloc")


class TritonPythonModel:
    def initialize(self, args):
        # Small tensor ops only: intra-op threads would spin on cores hstu_compute needs.
        torch.set_num_threads(1)
        hand_over_gil_promptly()  # the control plane's thread answers commits while execute runs
        self.settings = ServingSettings.from_env()
        self.settings.prepare_run_dir()
        self.config = HSTUConfig.load(self.settings.model_dir)
        self.cache = open_kv_cache(self.config, self.settings, namespace=fingerprint(self.settings.model_dir),
                                   onboard_by_reader=self.settings.host_hit_copy == "reader")
        if self.cache.store is None:  # once per server: this is the ensemble's one cache owner
            logger.warning("kv_lookup_alloc: no host store (HSTU_STORE=%s): serving from the device cache alone, "
                           "so a history evicted from the page pool is recomputed. For the host tier, run "
                           "hstu-serve, or start the store and set HSTU_STORE=embedded as `hstu-serve --print-env` "
                           "prints", self.settings.store)
        published.publish(self.settings.pool_handle_path, self.cache.handle)
        self.compute_version = published.compute_version_file(self.settings)
        self.control = ControlServer(self.cache.manager, self.settings.control_endpoint)
        self.ops = torch.ops.kvlifecycle  # the serving path: lookup, allocate, onboard_launch of a batch
        self.ops_handle = ops.register(self.cache.manager)
        self.stages = StageTimer()
        self.metrics = KVMetrics(args["model_name"], args["model_instance_name"],
                                 [*OWNER_PUBLISHED, *stage_keys("apply_commits", "lookup", "allocate", "onboard_launch")],
                                 source=lambda: {**self.cache.stats(), **self.stages.stats()})
        logger.info("kv_lookup_alloc: pool %s, store %s, control %s", self.cache.pool.spec,
                    self.settings.store, self.settings.control_endpoint)

    def execute(self, requests):
        self._follow_compute_version()
        replies = [Reply() for _ in requests]
        batch = []
        try:
            inputs = read_ranking_batch(requests, self.config)  # every id range of the batch in one pass
            valid = [(reply, r) for reply, r in zip(replies, inputs) if not isinstance(r, BadRequest)]
            for reply, r in zip(replies, inputs):
                if isinstance(r, BadRequest):
                    reply.answer(r.response())
            tokens = history_tokens_many([(r.item_ids, r.action_ids) for _, r in valid], self.config)
            batch = [OwnerRequest(reply, r, t) for (reply, r), t in zip(valid, tokens)]
        except Exception as e:  # a bug must fail this batch's requests, not the instance
            logger.error("kv_lookup_alloc failed to read a batch of %d", len(requests), exc_info=True)
            for reply in replies:
                reply.answer(error_response(f"kv_lookup_alloc: internal error: {e}"))
        self._serve_batch(batch)
        return [reply.response for reply in replies]

    def finalize(self):
        ops.unregister(self.ops_handle)
        self.metrics.close()
        self.control.close()
        self.cache.close()
        published.unpublish(self.settings.pool_handle_path)

    # ---- helpers ----------------------------------------------------------------------------

    def _follow_compute_version(self) -> None:
        """New leases are made in the namespace of the hstu_compute version that loaded last (a
        rollout): the lease carries it to hstu_compute, which refuses a lease of another one."""
        try:
            version = self.compute_version.poll()
            if version is None or version["server_pid"] != os.getppid():  # none yet, or a previous server's
                return
        except (OSError, ValueError, KeyError):  # a foreign or damaged file must not fail the batch
            logger.warning("kv_lookup_alloc: cannot read %s; keeping KV namespace %s",
                           self.settings.compute_version_path, self.cache.manager.namespace[:12], exc_info=True)
            return
        if version["namespace"] != self.cache.manager.namespace:
            logger.info("kv_lookup_alloc: hstu_compute version %s serves (KV namespace %s, was %s); new leases "
                        "use it, and the old namespace's pages age out of the pool", version["version"],
                        version["namespace"][:12], self.cache.manager.namespace[:12])
            self.cache.manager.use_namespace(version["namespace"])

    def _serve_batch(self, batch: list["OwnerRequest"]) -> None:
        """`_serve` the batch; if it fails (a bug), each request alone, so that it fails that
        request only."""
        try:
            self._serve(batch)
        except Exception:
            logger.error("kv_lookup_alloc failed on a batch of %d; serving them one by one", len(batch), exc_info=True)
            for item in batch:
                if item.reply.response is not None:
                    continue
                try:
                    self._serve([item])
                except Exception as e:
                    logger.error("kv_lookup_alloc failed on a request", exc_info=True)
                    item.reply.answer(error_response(f"kv_lookup_alloc: internal error: {e}"))

    def _serve(self, batch: list["OwnerRequest"]) -> None:
        """Lookup, allocate and launch the onboards of the whole batch through the custom ops (one
        manager call per step for the batch: `kvlifecycle.ops`), and answer each request."""
        if not batch:
            return
        manager = self.cache.manager
        started = time.perf_counter()
        # Every commit kv_offload announced before it answered is applied first: a user's request
        # sent after its previous answer finds that request's pages (kvlifecycle/commit_channel.py).
        self.control.drain_commits()
        drained = time.perf_counter()
        user_ids = torch.tensor([item.inputs.user_id for item in batch], dtype=torch.int64)
        tokens, offsets = ops.join_tokens([item.tokens for item in batch])
        # The store is not asked here: the control plane's thread asks it about each onboard started.
        hits = self.ops.lookup(self.ops_handle, user_ids, tokens, offsets)
        looked_up = time.perf_counter()
        leases, page_rows = self.ops.allocate(self.ops_handle, user_ids, tokens, offsets, hits, self.settings.lease_ttl_s)
        allocated = time.perf_counter()
        try:
            launched_leases = leases  # a batch with no onboard page reserved has none to launch
            reader_keys = [()] * len(batch)
            if bool((leases[:, 2] > 0).any()):
                launched_leases = self.ops.onboard_launch(self.ops_handle, leases)  # settled within the onboard wait
                if manager.onboard_by_reader:  # hstu_compute copies them from the store's slab: their keys
                    reader_keys = manager.reader_onboard_keys(launched_leases[:, 0].tolist())
                self.control.wake()  # its thread asks the store and starts the copies now
            launched = time.perf_counter()
            tag = namespace_tag(manager.namespace)  # the batch's leases were made in it
            responses = [self._response(item, lease, allocated_lease, row, keys, tag) for item, lease, allocated_lease, row, keys
                         in zip(batch, launched_leases.tolist(), leases[:, 0].tolist(), page_rows, reader_keys)]
        except Exception:
            for lease_id in leases[:, 0].tolist():  # the caller serves them again: their pages return now
                if lease_id >= 0:
                    manager.abort(lease_id)
            raise
        for item, response in zip(batch, responses):
            item.reply.answer(response)
        # Every request of the batch spent the whole of each step in it.
        n = len(batch)
        self.stages.add("apply_commits", drained - started, n)
        self.stages.add("lookup", looked_up - drained, n)
        self.stages.add("allocate", allocated - looked_up, n)
        self.stages.add("onboard_launch", launched - allocated, n)

    def _response(self, item: "OwnerRequest", lease: list[int], allocated_lease_id: int, page_row: torch.Tensor,
                  onboard_keys: tuple[bytes, ...], tag: int):
        """The request's plan; `lease` is its (lease_id, cached_len, onboard pages being copied) row;
        `onboard_keys` the keys of the onboard pages hstu_compute copies itself (none: the owner's copy);
        `tag` the lease's KV namespace tag."""
        lease_id, cached_len, copying = lease
        if allocated_lease_id < 0:
            stats = self.cache.manager.stats()
            return error_response(f"KV page pool exhausted, retry later: {item.tokens.numel()} tokens of user "
                                  f"{item.inputs.user_id} do not fit now ({stats['pages_free']} of "
                                  f"{stats['pages_total']} pages free, {stats['pages_pinned']} pinned, "
                                  f"{stats['pages_leased']} leased)")
        if lease_id < 0:  # its lease ended during its onboard's launch (aborted, or no fresh pages)
            return error_response(f"kv_lookup_alloc: lease {allocated_lease_id} ended while its onboard started; "
                                  "retry the request")
        page_size = self.cache.pool.spec.page_size
        onboard_len = copying * page_size  # a refused onboard only shrank cached_len
        num_pages = -(-item.tokens.numel() // page_size)  # the lease's row; -1 pads it in page_row
        plan = ComputePlan(new_tokens=item.tokens[cached_len - onboard_len:], cached_len=cached_len,
                           onboard_len=onboard_len, page_row=page_row[:num_pages], candidates=item.inputs.candidate_ids,
                           namespace_tag=tag, lease_id=lease_id,
                           onboard_keys=torch.from_numpy(keys_to_words(list(onboard_keys))) if onboard_keys else NO_KEYS)
        return pb_utils.InferenceResponse(output_tensors=[output_tensor("compute_plan", plan.pack().reshape(1, -1))])


class OwnerRequest:
    """A validated request until it is answered: its reply, inputs and history tokens."""

    def __init__(self, reply: Reply, inputs: RankingInputs, tokens: torch.Tensor) -> None:
        self.reply = reply
        self.inputs = inputs
        self.tokens = tokens
