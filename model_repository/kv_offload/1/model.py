"""kv_offload: commit the batch, answer, and offload off the request's critical path.

Dynamic batching hands `execute` every queued request. It reads each one's lease id (one value
of kv_lookup_alloc's plan), commits every lease of the batch with the owner (kv_lookup_alloc) in
one control round trip, and answers with the scores. Committing before answering is what lets
the owner never wait: once a client has its answer, its next request finds these pages on the
device. The pages to put go to the background `OffloadWorker` with the history of the requests
that have any (`input_tensor` copies it: the request's buffers end with `execute`), which makes
their token ids, puts them into the host store and reaps finished puts, after the answer.
`finalize` (model unload, server stop) flushes: it waits for every pending offload before
returning.
"""
import logging
import time

import torch
import triton_python_backend_utils as pb_utils

from compute import HSTUConfig, history_tokens
from deploy.runtime import published
from deploy.runtime.compute_plan import ComputePlan
from deploy.runtime.cache_owner import open_store_client, pool_spec
from kvlifecycle.gil import hand_over_gil_promptly
from deploy.runtime.settings import ServingSettings
from deploy.runtime.triton_io import error_response, input_tensor, input_view, output_tensor
from deploy.runtime.triton_metrics import OFFLOAD_KEYS, KVMetrics, StageTimer, stage_keys
from kvlifecycle.offload_worker import OffloadWorker
from kvlifecycle.control import ControlClient

logger = logging.getLogger("kv_offload")

FLUSH_TIMEOUT_S = 60.0


class TritonPythonModel:
    def initialize(self, args):
        # Small tensor ops only: intra-op threads would spin on cores hstu_compute needs.
        torch.set_num_threads(1)
        hand_over_gil_promptly()  # execute and the offload worker share this process's GIL
        self.settings = ServingSettings.from_env()
        self.settings.prepare_run_dir()  # the owner's pool handle and control socket live there
        self.config = HSTUConfig.load(self.settings.model_dir)
        self.control = ControlClient(self.settings.control_endpoint)
        spec = pool_spec(self.config, self.settings)
        self.store = open_store_client(self.settings, spec.page_size)
        self.owner_pool = published.pool_handle_file(self.settings)
        self.stages = StageTimer()
        self.worker = OffloadWorker(self.control, self.store, page_bytes=spec.page_bytes, page_size=spec.page_size,
                                    before_put=self._register_owner_pool,
                                    on_commit=lambda seconds, leases: self.stages.add("commit", seconds, leases),
                                    # checked again (off the request's path): a history this process read
                                    # differently from the owner is never put under the wrong keys
                                    tokens_of=lambda history: history_tokens(*history, self.config))
        self.worker.start()
        self.metrics = KVMetrics(args["model_name"], args["model_instance_name"], OFFLOAD_KEYS + stage_keys("commit"),
                                 source=lambda: {**self.worker.stats(), **self.stages.stats()})

    def execute(self, requests):
        responses: list = [None] * len(requests)
        lease_ids, answered = [], []  # per request read: its lease id, its index
        for i, request in enumerate(requests):
            try:
                scores = input_tensor(request, "candidate_scores")  # [1, c, num_tasks]
                lease_ids.append(ComputePlan.lease_id_of(input_view(request, "compute_plan")))
            except Exception as e:
                logger.error("kv_offload: malformed request", exc_info=True)
                responses[i] = error_response(f"kv_offload: {e}")
                continue
            responses[i] = pb_utils.InferenceResponse(output_tensors=[output_tensor("scores", scores)])
            answered.append(i)
        puts = []
        for i, committed in zip(answered, self.worker.commit(lease_ids)):
            if committed.items:  # the history only of the requests with pages to put
                history = tuple(input_tensor(requests[i], name).reshape(-1) for name in ("item_ids", "action_ids"))
                puts.append((committed.namespace, history, committed.items))
        self.worker.submit(puts)  # returns at once; the worker thread offloads
        return responses

    def _register_owner_pool(self):
        """Name kv_lookup_alloc's pool (again when it re-created it) to the store client: the
        pages to offload are in that pool. It is published: kv_lookup_alloc answered these requests.
        Runs on the worker's thread."""
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
