"""kv_offload: commit the batch, answer, and offload off the request's critical path.

Dynamic batching hands `execute` every queued request. It reads each one's lease id (one value
of kv_lookup_alloc's plan) and history, checks the histories' ids in one pass, and calls the
custom op `torch.ops.kvlifecycle.offload_launch` (`kvlifecycle/ops.py`) for the batch: it
announces the commit of every lease to the owner (kv_lookup_alloc) as one datagram, without a
round trip (`kvlifecycle/commit_channel.py`), and hands the token ids to the background
`OffloadWorker`; then `execute` answers with the scores. The owner applies the commit before its
next lookup, so once a client has its answer, its next request finds these pages on the device;
the owner sends the worker the pages it pinned, and the worker puts them into the host store and
reaps finished puts, after the answer.
`finalize` (model unload, server stop) flushes: it waits for every pending offload before
returning.
"""
import logging
import time

import torch
import triton_python_backend_utils as pb_utils

from compute import HSTUConfig, history_tokens_many
from compute.tokens import check_history, ids_in_range
from deploy.runtime import published
from deploy.runtime import sealed_scores
from deploy.runtime.compute_plan import ComputePlan
from deploy.runtime.cache_owner import open_store_client, pool_spec
from kvlifecycle.gil import hand_over_gil_promptly
from deploy.runtime.settings import ServingSettings
from deploy.runtime.triton_io import error_response, input_tensors, output_tensor
from deploy.runtime.triton_metrics import KVMetrics, StageTimer, stage_keys
from kvlifecycle.stats_keys import OFFLOAD_PUBLISHED
from kvlifecycle import ops
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
                                    on_commit=lambda seconds, leases: self.stages.add("commit", seconds, leases))
        self.worker.start()
        self.ops = torch.ops.kvlifecycle
        self.ops_handle = ops.register(self.control, self.worker)  # offload_launch: commit announced, put on the worker
        self.metrics = KVMetrics(args["model_name"], args["model_instance_name"], [*OFFLOAD_PUBLISHED, *stage_keys("commit")],
                                 source=lambda: {**self.worker.stats(), **self.stages.stats()})

    def execute(self, requests):
        responses: list = [None] * len(requests)
        lease_ids, histories = [], []  # of the requests read
        for i, request in enumerate(requests):
            try:
                sealed, items, actions, plan = input_tensors(request, ("candidate_scores", "item_ids", "action_ids"),
                                                             views=("compute_plan",))
                scores = sealed_scores.unseal(sealed[0])  # [c, num_tasks]
                lease_ids.append(ComputePlan.lease_id_of(plan))
                histories.append((items.reshape(-1), actions.reshape(-1)))
            except Exception as e:
                logger.error("kv_offload: malformed request", exc_info=True)
                responses[i] = error_response(f"kv_offload: {e}")
                continue
            if scores is None:  # changed in transit (its lease is still committed: the KV is right)
                logger.error("kv_offload: a request's scores do not match their checksum; answered retryable")
                responses[i] = error_response("kv_offload: the scores changed in transit between hstu_compute "
                                              "and kv_offload; resend the request", retryable=True)
            else:
                responses[i] = pb_utils.InferenceResponse(output_tensors=[output_tensor("scores", scores.unsqueeze(0))])
        if lease_ids:
            try:
                tokens, offsets = ops.join_tokens(history_tokens_many(self._checked(histories), self.config))
                # announces the batch's commit before the answers (no round trip); the puts run on the worker
                self.ops.offload_launch(self.ops_handle, torch.tensor(lease_ids, dtype=torch.int64), tokens, offsets)
            except Exception:  # a bug: the scores stand; the leases return on expiry
                logger.error("kv_offload: commit and offload of a batch of %d failed", len(lease_ids), exc_info=True)
        return responses

    def _checked(self, histories: list[tuple[torch.Tensor, torch.Tensor]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The histories, each emptied if its ids break the token contract (one range pass over the
        batch; a request's own check only when that pass fails): its lease is still committed, but
        a history this process read differently from the owner is never put under its keys."""
        if (all(items.numel() == actions.numel() for items, actions in histories)
                and ids_in_range([items for items, _ in histories], 1, self.config.item_vocab)
                and ids_in_range([actions for _, actions in histories], 0, self.config.action_vocab)):
            return histories
        checked = []
        for history in histories:
            problem = check_history(*history, self.config)
            if problem is not None:
                logger.error("kv_offload: a request's history arrived with %s; its pages are not offloaded", problem)
                history = history[0][:0], history[1][:0]
            checked.append(history)
        return checked

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
        ops.unregister(self.ops_handle)
        left = self.worker.stop(flush_timeout_s=FLUSH_TIMEOUT_S)
        if left:
            logger.warning("kv_offload: %d offloads still pending after %.0fs; their pages were not offloaded",
                           left, FLUSH_TIMEOUT_S)
        self.metrics.close()
        if self.store is not None:
            self.store.close()
        self.control.close()
        logger.info("kv_offload: finalized in %.1f s (%d offloads left)", time.monotonic() - started, left)
