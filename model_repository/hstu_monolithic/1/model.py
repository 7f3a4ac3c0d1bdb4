"""hstu_monolithic: today's public deployment shape, the baseline every benchmark compares with.

One instance, `max_batch_size: 0`, one request per call, and everything on the request's
critical path, as in recsys-examples' Triton deployment: lookup -> allocate -> onboard ->
compute -> commit -> offload launch -> wait -> reap. It uses the same kvlifecycle and compute
code as the ensemble, with its own page pool (the same size) so the two never share state.
"""
import logging

import triton_python_backend_utils as pb_utils

from compute import HSTUConfig, PagedBatch, fingerprint, history_tokens, load_compiled
from deploy.runtime.cache_owner import open_kv_cache
from deploy.runtime.settings import ServingSettings
from deploy.runtime.triton_io import BadRequest, error_response, output_tensor, read_ranking_request
from deploy.runtime.triton_metrics import KVMetrics
from kvlifecycle.stats_keys import OWNER_PUBLISHED
from kvlifecycle.offload_worker import Offloader
from kvlifecycle.page_table import PoolExhausted

logger = logging.getLogger("hstu_monolithic")


class TritonPythonModel:
    def initialize(self, args):
        self.settings = ServingSettings.from_env()
        self.config = HSTUConfig.load(self.settings.model_dir)
        self.cache = open_kv_cache(self.config, self.settings, namespace=fingerprint(self.settings.model_dir))
        self.run = load_compiled(self.settings.model_dir, self.settings.device)
        manager = self.cache.manager
        self.offloader = (Offloader(self.cache.store, manager.page_size, manager.offload_done)
                          if self.cache.store is not None else None)
        self.metrics = KVMetrics(args["model_name"], args["model_instance_name"], list(OWNER_PUBLISHED), source=self.cache.stats)

    def execute(self, requests):
        return [self._one(request) for request in requests]

    def _one(self, request):
        manager = self.cache.manager
        lease_id = None
        try:
            r = read_ranking_request(request, self.config)
            tokens = history_tokens(r.item_ids, r.action_ids, self.config)
            manager.expire_leases()
            hit = manager.lookup(r.user_id, tokens)  # the onboard asks the store, in one round trip
            lease = manager.allocate(r.user_id, tokens, hit)
            lease_id = lease.lease_id
            lease = manager.onboard(lease)
            batch = PagedBatch.from_requests([(tokens[lease.cached_len:], lease.cached_len,
                                               list(lease.page_row), r.candidate_ids)])
            scores = self.run(self.cache.pool.tensor, batch).cpu()  # [c, num_tasks]; waits for the KV writes
            items = manager.commit(lease_id)
            lease_id = None
            if self.offloader is not None and items:
                self.offloader.launch(hit.namespace, tokens, items)
                self.offloader.flush(self.settings.timeouts.offload_wait_s)  # wait + reap, on the critical path
        except BadRequest as e:
            return e.response()
        except PoolExhausted as e:
            return error_response(f"KV page pool exhausted, retry later: {e}")
        except Exception as e:
            logger.error("hstu_monolithic failed on a request", exc_info=True)
            return error_response(f"hstu_monolithic: internal error: {e}")
        finally:
            if lease_id is not None:
                manager.abort(lease_id)
        return pb_utils.InferenceResponse(output_tensors=[output_tensor("scores", scores)])

    def finalize(self):
        if self.offloader is not None:
            self.offloader.flush(self.settings.timeouts.offload_wait_s)
        self.metrics.close()
        self.cache.close()
