"""kv_offload: commit, answer, then offload off the request's critical path.

Dynamic batching hands `execute` every queued request. It commits their leases with the owner
(kv_lookup_alloc) in one control round trip (`commit_many`; before the answers, so a user's next
request, which can only follow its answer, finds the new pages), answers with the scores, and
hands each lease's committed pages, with the namespace the lease was made in, to the background
`OffloadWorker`, which puts them into the host store and reaps finished puts after `execute` has
returned. The lease id comes from kv_lookup_alloc; the history (the store keys pages by their
token ids) from the request. The model is not decoupled:
the offload never ran inside `execute`, and a decoupled sender costs a synchronous round trip to
the server per send. `finalize` (model unload, server stop) flushes: it
waits for every pending offload before returning.
"""
import logging
import time

import triton_python_backend_utils as pb_utils

from compute import HSTUConfig, history_tokens
from deploy.runtime import published
from deploy.runtime.cache_owner import open_store_client, pool_spec
from deploy.runtime.gil import hand_over_gil_promptly
from deploy.runtime.settings import ServingSettings
from deploy.runtime.triton_io import error_response, input_tensor, output_tensor
from deploy.runtime.triton_metrics import OFFLOAD_KEYS, KVMetrics, StageTimer, stage_keys
from kvlifecycle.offload_worker import OffloadWorker
from kvlifecycle.control import ControlClient
from kvlifecycle.page_table import Committed

logger = logging.getLogger("kv_offload")

FLUSH_TIMEOUT_S = 60.0


class TritonPythonModel:
    def initialize(self, args):
        hand_over_gil_promptly()  # execute and the offload worker share this process's GIL
        self.settings = ServingSettings.from_env()
        self.settings.prepare_run_dir()  # the owner's pool handle and control socket live there
        self.config = HSTUConfig.load(self.settings.model_dir)
        self.control = ControlClient(self.settings.control_endpoint)
        spec = pool_spec(self.config, self.settings)
        self.store = open_store_client(self.settings, spec.page_size)
        self.owner_pool = published.pool_handle_file(self.settings)
        self.worker = OffloadWorker(self.control, self.store, page_bytes=spec.page_bytes, page_size=spec.page_size)
        self.worker.start()
        self.stages = StageTimer()
        self.metrics = KVMetrics(args["model_name"], args["model_instance_name"], OFFLOAD_KEYS + stage_keys("commit"),
                                 source=lambda: {**self.worker.stats(), **self.stages.stats()})

    def execute(self, requests):
        responses = [None] * len(requests)
        finished = []  # (request index, lease id, history tokens)
        for i, request in enumerate(requests):
            try:
                scores = input_tensor(request, "candidate_scores")  # [1, c, num_tasks]
                lease_id = int(input_tensor(request, "lease_id").reshape(-1)[0])
                tokens = history_tokens(input_tensor(request, "item_ids").reshape(-1),
                                        input_tensor(request, "action_ids").reshape(-1), self.config)
            except Exception as e:
                logger.error("kv_offload: malformed request", exc_info=True)
                responses[i] = error_response(f"kv_offload: {e}")
                continue
            responses[i] = pb_utils.InferenceResponse(output_tensors=[output_tensor("scores", scores)])
            finished.append((i, lease_id, tokens))
        if not finished:
            return responses
        started = time.perf_counter()
        committed = self._commit([lease_id for _, lease_id, _ in finished])
        self.stages.add("commit", time.perf_counter() - started, len(finished))
        if any(c.items for c in committed):
            self._register_owner_pool()
            for (_, _, tokens), c in zip(finished, committed):
                self.worker.submit(c.namespace, tokens, c.items)  # returns at once; the worker thread offloads
        return responses

    def _commit(self, lease_ids: list[int]) -> list[Committed]:
        """The leases' new pages become visible; returns, per lease, those to offload. A failed
        commit costs only these requests' cache: the owner's lease expiry returns the pages."""
        try:
            return self.control.commit_many(lease_ids)
        except Exception:
            logger.warning("kv_offload: commit of leases %s failed; their pages return on expiry", lease_ids,
                           exc_info=True)
            return []

    def _register_owner_pool(self):
        """Name kv_lookup_alloc's pool (again when it re-created it) to the store client: the
        pages to offload are in that pool. It is published: kv_lookup_alloc answered this request."""
        if self.store is None:
            return
        try:
            handle = self.owner_pool.poll()
            if handle is not None:
                self.store.register_pool(handle)
        except (OSError, ValueError, RuntimeError):
            logger.warning("kv_offload: cannot register the owner's pool from %s; offloads fail until it can",
                           self.settings.pool_handle_path, exc_info=True)

    def finalize(self):
        started = time.monotonic()
        left = self.worker.stop(flush_timeout_s=FLUSH_TIMEOUT_S)
        if left:
            logger.warning("kv_offload: %d offloads still pending after %.0fs; their pages were not offloaded",
                           left, FLUSH_TIMEOUT_S)
        self.metrics.close()
        if self.store is not None:
            self.store.close()
        self.control.close()
        logger.info("kv_offload: finalized in %.1f s (%d offloads left)", time.monotonic() - started, left)
