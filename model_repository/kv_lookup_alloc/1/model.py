"""kv_lookup_alloc: the owner of the KV cache. Per batch: validate -> lookup -> allocate -> launch onboards.

One instance (one process) owns the page table; it creates the device page pool at `initialize`
and publishes its handle for hstu_compute and the host store, and serves the control plane that
kv_offload (commits, offload completions) and hstu_compute (aborts) talk to.

Dynamic batching hands `execute` every queued request. They go through the cache together
(`KVCacheManager.lookup_many`, `allocate_many`, `onboard_start_many`): one table lock per step.
A request with pages beyond its device prefix (`min_host_pages` or more) is answered at once
with them as onboard pages (`onboard_len`), without asking the host store here: the control
plane's thread asks it (one round trip: copy the ones you hold) and settles each copy when the
store reports it done, or as a timeout; pages not copied are recomputed. hstu_compute asks this
process's control plane how that request's onboard ended before it reads them, so neither a
store round trip nor a slow copy holds another request here. The request's namespace,
page keys and token ids are fixed here, once, and travel with its lease. A bad request or an
exhausted pool becomes an error response for that request only and changes no cache state.
"""
import logging
import os
import time

import torch
import triton_python_backend_utils as pb_utils

from compute import HSTUConfig, fingerprint, history_tokens
from deploy.runtime import published
from deploy.runtime.compute_plan import ComputePlan
from deploy.runtime.cache_owner import open_kv_cache
from kvlifecycle.gil import hand_over_gil_promptly
from deploy.runtime.settings import ServingSettings
from deploy.runtime.triton_io import BadRequest, RankingInputs, error_response, output_tensor, read_ranking_request
from deploy.runtime.triton_metrics import OWNER_KEYS, KVMetrics, StageTimer, stage_keys
from kvlifecycle.control import ControlServer
from kvlifecycle.hashing import namespace_tag
from kvlifecycle.leases import Lease
from kvlifecycle.page_table import PoolExhausted

logger = logging.getLogger("kv_lookup_alloc")


class TritonPythonModel:
    def initialize(self, args):
        # Small tensor ops only: intra-op threads would spin on cores hstu_compute needs.
        torch.set_num_threads(1)
        hand_over_gil_promptly()  # the control plane's thread answers commits while execute runs
        self.settings = ServingSettings.from_env()
        self.settings.prepare_run_dir()
        self.config = HSTUConfig.load(self.settings.model_dir)
        # kv_offload commits after it answers: a user's next request may find its previous
        # request's pages not committed yet, and waits for them (ServingSettings.commit_wait_s)
        self.cache = open_kv_cache(self.config, self.settings, namespace=fingerprint(self.settings.model_dir),
                                   commit_wait_s=self.settings.commit_wait_s)
        if self.cache.store is None:  # once per server: this is the ensemble's one cache owner
            logger.warning("kv_lookup_alloc: no host store (HSTU_STORE=%s): serving from the device cache alone, "
                           "so a history evicted from the page pool is recomputed. For the host tier, run "
                           "hstu-serve, or start the store and set HSTU_STORE=embedded as `hstu-serve --print-env` "
                           "prints", self.settings.store)
        published.publish(self.settings.pool_handle_path, self.cache.handle)
        self.compute_version = published.compute_version_file(self.settings)
        self.control = ControlServer(self.cache.manager, self.settings.control_endpoint)
        self.stages = StageTimer()
        self.metrics = KVMetrics(args["model_name"], args["model_instance_name"],
                                 OWNER_KEYS + stage_keys("lookup", "allocate", "onboard_launch"),
                                 source=lambda: {**self.cache.stats(), **self.stages.stats()})
        logger.info("kv_lookup_alloc: pool %s, store %s, control %s", self.cache.pool.spec,
                    self.settings.store, self.settings.control_endpoint)

    def execute(self, requests):
        self._follow_compute_version()
        responses = [None] * len(requests)
        parsed = {}  # request index -> (inputs, history tokens)
        for i, request in enumerate(requests):
            try:
                r = read_ranking_request(request, self.config)
                parsed[i] = (r, history_tokens(r.item_ids, r.action_ids, self.config, checked=True))
            except BadRequest as e:
                responses[i] = error_response(str(e))
            except Exception as e:  # a bug must fail this request only, not the batch
                logger.error("kv_lookup_alloc failed to read a request", exc_info=True)
                responses[i] = error_response(f"kv_lookup_alloc: internal error: {e}")
        members = list(parsed)
        try:
            served = self._serve([parsed[i] for i in members])
        except Exception:  # a bug: retry each request alone, so that it fails that request only
            logger.error("kv_lookup_alloc failed on a batch of %d; serving them one by one", len(members),
                         exc_info=True)
            served = [self._serve_alone(parsed[i]) for i in members]
        for i, response in zip(members, served):
            responses[i] = response
        return responses

    def finalize(self):
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

    def _serve(self, batch: list[tuple[RankingInputs, torch.Tensor]]) -> list:
        """A response for each (inputs, tokens): lookup, allocate and launch the onboards of the
        whole batch."""
        if not batch:
            return []
        manager = self.cache.manager
        n = len(batch)
        started = time.perf_counter()
        # The store is not asked here: the control plane's thread asks it about each onboard started.
        hits = manager.lookup_many([(r.user_id, tokens) for r, tokens in batch], ask_store=False)
        looked_up = time.perf_counter()
        leases = manager.allocate_many(hits, ttl_s=self.settings.lease_ttl_s)
        allocated = time.perf_counter()
        try:
            leases = manager.onboard_start_many(leases)  # settled within settings.timeouts.onboard_wait_s
            if any(isinstance(lease, Lease) and lease.onboarding for lease in leases):
                self.control.wake()  # its thread asks the store and starts the copies now
            launched = time.perf_counter()
            responses = [self._response(r, tokens, lease) for (r, tokens), lease in zip(batch, leases)]
        except Exception:
            for lease in leases:  # the caller serves them again: their pages return now, not at expiry
                if isinstance(lease, Lease):
                    manager.abort(lease.lease_id)
            raise
        # Every request of the batch spent the whole of each step in it.
        self.stages.add("lookup", looked_up - started, n)
        self.stages.add("allocate", allocated - looked_up, n)
        self.stages.add("onboard_launch", launched - allocated, n)
        return responses

    def _serve_alone(self, item: tuple[RankingInputs, torch.Tensor]):
        try:
            return self._serve([item])[0]
        except Exception as e:
            logger.error("kv_lookup_alloc failed on a request", exc_info=True)
            return error_response(f"kv_lookup_alloc: internal error: {e}")

    def _response(self, r: RankingInputs, tokens: torch.Tensor, lease):
        if isinstance(lease, PoolExhausted):
            return error_response(f"KV page pool exhausted, retry later: {lease}")
        if not isinstance(lease, Lease):  # LeaseGone: aborted during its onboard's launch
            return error_response(f"kv_lookup_alloc: internal error: {lease}")
        cached_len = lease.cached_len  # a refused onboard only shrank cached_len
        onboard_len = lease.num_onboard_pages * lease.page_size if lease.onboarding else 0
        plan = ComputePlan(new_tokens=tokens[cached_len - onboard_len:], cached_len=cached_len, onboard_len=onboard_len,
                           page_row=torch.as_tensor(lease.page_row, dtype=torch.int64), candidates=r.candidate_ids,
                           namespace_tag=namespace_tag(lease.namespace), lease_id=lease.lease_id)
        return pb_utils.InferenceResponse(output_tensors=[output_tensor("compute_plan", plan.pack().reshape(1, -1))])
