"""kv_lookup_alloc: the owner of the KV cache. Per request: validate -> lookup -> allocate -> onboard.

One instance (one process) owns the page table; it creates the device page pool at `initialize`
and publishes its handle for hstu_compute and the host store, and serves the control plane that
kv_offload (commits, offload completions) and hstu_compute (aborts) talk to. A bad request or an
exhausted pool becomes an error response for that request only and changes no cache state.
"""
import logging

import torch
import triton_python_backend_utils as pb_utils

from compute import HSTUConfig, fingerprint, history_tokens
from deploy.runtime import pool_handle
from deploy.runtime.cache_owner import open_kv_cache
from deploy.runtime.settings import ServingSettings
from deploy.runtime.triton_io import BadRequest, error_response, output_tensor, read_ranking_request
from deploy.runtime.triton_metrics import OWNER_KEYS, KVMetrics, StageTimer, stage_keys
from kvlifecycle import ops
from kvlifecycle.control import ControlServer
from kvlifecycle.page_table import PoolExhausted

logger = logging.getLogger("kv_lookup_alloc")


class TritonPythonModel:
    def initialize(self, args):
        self.settings = ServingSettings.from_env()
        self.settings.prepare_run_dir()
        self.config = HSTUConfig.load(self.settings.model_dir)
        self.cache = open_kv_cache(self.config, self.settings, namespace=fingerprint(self.settings.model_dir))
        if self.cache.store is None:  # once per server: this is the ensemble's one cache owner
            logger.warning("kv_lookup_alloc: no host store (HSTU_STORE=%s): serving from the device cache alone, "
                           "so a history evicted from the page pool is recomputed. For the host tier, run "
                           "hstu-serve, or start the store and set HSTU_STORE=embedded as `hstu-serve --print-env` "
                           "prints", self.settings.store)
        self.handle = ops.register(self.cache.manager)
        pool_handle.publish(self.settings.pool_handle_path, self.cache.handle)
        self.control = ControlServer(self.cache.manager, self.settings.control_endpoint)
        self.stages = StageTimer()
        self.metrics = KVMetrics(args["model_name"], OWNER_KEYS + stage_keys("lookup", "allocate", "onboard"),
                                 source=lambda: {**self.cache.stats(), **self.stages.stats()})
        logger.info("kv_lookup_alloc: pool %s, store %s, control %s", self.cache.pool.spec,
                    self.settings.store, self.settings.control_endpoint)

    def execute(self, requests):
        return [self._one(request) for request in requests]

    def _one(self, request):
        lease_id = None
        try:
            r = read_ranking_request(request, self.config)
            tokens = history_tokens(r.item_ids, r.action_ids, self.config)
            user = torch.tensor([r.user_id], dtype=torch.int64)
            with self.stages.time("lookup"):
                hit = ops.lookup(self.handle, user, tokens)  # [device_tokens, host_tokens]
            with self.stages.time("allocate"):
                meta, page_row = ops.allocate(self.handle, user, tokens, hit, self.config.page_size,
                                              self.settings.lease_ttl_s)  # meta: [lease_id, cached_len, onboard]
            lease_id = int(meta[0])
            with self.stages.time("onboard"):
                task = ops.onboard_launch(self.handle, meta)
                meta = ops.onboard_wait(self.handle, meta, task, self.settings.store_timeout_s * 4)
            cached_len = int(meta[1])  # a failed onboard only shrinks cached_len
        except BadRequest as e:
            return error_response(str(e))
        except PoolExhausted as e:
            return error_response(f"KV page pool exhausted, retry later: {e}")
        except Exception as e:  # a bug must fail this request only, not the batch
            logger.error("kv_lookup_alloc failed on a request", exc_info=True)
            if lease_id is not None:
                self.cache.manager.abort(lease_id)  # its pages return now, not at lease expiry
            return error_response(f"kv_lookup_alloc: internal error: {e}")
        row = lambda values: torch.as_tensor(values, dtype=torch.int64).reshape(1, -1)  # noqa: E731
        return pb_utils.InferenceResponse(output_tensors=[
            output_tensor("new_tokens", row(tokens[cached_len:])),
            output_tensor("cached_len", row([cached_len])),
            output_tensor("page_row", row(page_row)),
            output_tensor("candidates", row(r.candidate_ids)),
            output_tensor("lease_id", row([lease_id])),
        ])

    def finalize(self):
        self.metrics.close()
        self.control.close()
        ops.unregister(self.handle)
        self.cache.close()
        pool_handle.unpublish(self.settings.pool_handle_path)
