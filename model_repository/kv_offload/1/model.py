"""kv_offload: answer, then commit and offload off the request's critical path.

Dynamic batching hands `execute` every queued request. It answers them with the scores and
hands each one's lease id and history (`input_tensor` copies it: the request's buffers end with
`execute`) to the background `OffloadWorker`, which commits every lease queued since its last
turn with the owner (kv_lookup_alloc) in one control round trip, puts the committed pages into
the host store, and reaps finished puts. The token ids the store keys pages by are made there,
only for the requests with pages to put (kv_lookup_alloc validated every history already).
Committing after the answer takes the control round trip (0.6-1.2 ms on the H200 host) off
every request and off this model's `execute`; a user's next request, which can arrive before
that commit lands, waits for it in the owner (`HSTU_COMMIT_WAIT_S`, 0.25 s at most by default),
so it still finds the pages. The model is not decoupled: the offload never ran inside
`execute`, and a decoupled sender costs a synchronous round trip to the server per send.
`finalize` (model unload, server stop) flushes: it commits what is queued and waits for every
pending offload before returning.
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
from deploy.runtime.triton_io import error_response, input_tensor, output_tensor
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
                                    tokens_of=lambda history: history_tokens(*history, self.config, checked=True))
        self.worker.start()
        self.metrics = KVMetrics(args["model_name"], args["model_instance_name"], OFFLOAD_KEYS + stage_keys("commit"),
                                 source=lambda: {**self.worker.stats(), **self.stages.stats()})

    def execute(self, requests):
        responses = []
        finished = []  # (lease id, (item ids, action ids))
        for request in requests:
            try:
                scores = input_tensor(request, "candidate_scores")  # [1, c, num_tasks]
                lease_id = ComputePlan.lease_id_of(input_tensor(request, "compute_plan"))
                history = tuple(input_tensor(request, name).reshape(-1) for name in ("item_ids", "action_ids"))
            except Exception as e:
                logger.error("kv_offload: malformed request", exc_info=True)
                responses.append(error_response(f"kv_offload: {e}"))
                continue
            responses.append(pb_utils.InferenceResponse(output_tensors=[output_tensor("scores", scores)]))
            finished.append((lease_id, history))
        self.worker.submit(finished)  # returns at once; the worker thread commits and offloads
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
