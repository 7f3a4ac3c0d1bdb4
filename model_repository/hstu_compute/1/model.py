"""hstu_compute: one jagged batch of users through the AOTI package, per `execute`.

Dynamic batching hands `execute` every queued request; their new tokens, page rows and
candidates are ragged, so the batch is formed here (`PagedBatch.from_requests`), not padded by
Triton. The package reads each user's cached prefix from the shared page pool and writes the new
tokens' KV into it. If the batch fails, each request is retried alone so one bad request fails
alone; a failed request's lease is aborted so its pages return at once. It answers with the
scores only: kv_offload takes the request's lease id from kv_lookup_alloc itself.
"""
import logging
import time

import torch
import triton_python_backend_utils as pb_utils

from compute import PagedBatch, load_compiled, plan_sub_batches
from deploy.runtime import pool_handle
from deploy.runtime.settings import ServingSettings
from deploy.runtime.triton_io import error_response, input_tensor, output_tensor
from deploy.runtime.triton_metrics import KVMetrics, StageTimer, stage_keys
from kvlifecycle.control import ControlClient
from kvlifecycle.pool import PagePool

logger = logging.getLogger("hstu_compute")



class TritonPythonModel:
    def initialize(self, args):
        self.settings = ServingSettings.from_env()
        self.settings.prepare_run_dir()  # the owner's pool handle and control socket live there
        self.device = torch.device(self.settings.device)
        self.run = load_compiled(self.settings.model_dir, self.settings.device)
        self.control = ControlClient(self.settings.control_endpoint)
        self.pool = None  # attached at the first request: the owner may not have published it yet
        self.published_pool = pool_handle.PublishedHandle(self.settings.pool_handle_path)
        self.stages = StageTimer()
        self.metrics = KVMetrics(args["model_name"], stage_keys("compute"), source=self.stages.stats)

    def execute(self, requests):
        pool = self._attach_pool()
        parsed = [self._parse(r) for r in requests]
        good = [i for i, p in enumerate(parsed) if not isinstance(p, str)]
        responses = [error_response(p) if isinstance(p, str) else None for p in parsed]
        # (queries, keys) of each request: the padded forward's cost grows with the largest of both.
        shapes = [(parsed[i][0].numel() + parsed[i][3].numel(), parsed[i][1] + parsed[i][0].numel()) for i in good]
        for group in plan_sub_batches(shapes):
            members = [good[j] for j in group]
            started = time.perf_counter()
            try:
                for i, scores in zip(members, self._score(pool, [parsed[i] for i in members])):
                    responses[i] = self._response(scores)
                # each request of the sub-batch spent the whole call in compute
                self.stages.add("compute", time.perf_counter() - started, len(members))
            except Exception:
                logger.warning("batch of %d failed; retrying one by one", len(members), exc_info=True)
                for i in members:
                    responses[i] = self._score_alone(pool, parsed[i])
        return responses

    def finalize(self):
        self.metrics.close()
        self.control.close()
        if self.pool is not None:
            self.pool.close()

    # ---- helpers ----------------------------------------------------------------------------

    def _parse(self, request):
        """(new_tokens, cached_len, page_row, candidates, lease_id) or an error message."""
        try:
            new_tokens = input_tensor(request, "new_tokens").reshape(-1)
            cached_len = int(input_tensor(request, "cached_len").reshape(-1)[0])
            page_row = input_tensor(request, "page_row").reshape(-1)
            candidates = input_tensor(request, "candidates").reshape(-1)
            lease_id = int(input_tensor(request, "lease_id").reshape(-1)[0])
        except Exception as e:
            return f"hstu_compute: malformed request: {e}"
        return new_tokens, cached_len, page_row, candidates, lease_id

    def _score(self, pool: PagePool, items) -> list:
        batch = PagedBatch.from_requests([(t, c, p, cand) for t, c, p, cand, _ in items])
        scores = self.run(pool.tensor, batch)  # [sum c, num_tasks]
        if self.device.type == "cuda":
            torch.cuda.current_stream().synchronize()  # KV written before kv_offload commits it
        sizes = [int(item[3].numel()) for item in items]
        return list(torch.split(scores, sizes))

    def _score_alone(self, pool: PagePool, item):
        try:
            return self._response(self._score(pool, [item])[0])
        except Exception as e:
            logger.error("hstu_compute failed on lease %d", item[4], exc_info=True)
            self._abort(item[4])  # its pages return now, not at lease expiry
            return error_response(f"hstu_compute: {e}")

    def _response(self, scores: torch.Tensor):
        return pb_utils.InferenceResponse(output_tensors=[
            output_tensor("candidate_scores", scores.unsqueeze(0)),  # [1, c, num_tasks]
        ])

    def _abort(self, lease_id: int) -> None:
        try:
            self.control.abort(lease_id)
        except Exception:
            logger.warning("abort of lease %d not delivered; it expires instead", lease_id, exc_info=True)

    def _attach_pool(self) -> PagePool:
        handle = self.published_pool.poll()  # a new handle when kv_lookup_alloc (re)published it
        if handle is not None:
            if self.pool is not None:
                self.pool.close()
            self.pool = PagePool.attach(handle)
        return self.pool
