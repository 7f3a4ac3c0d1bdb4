"""compute: the HSTU ranking model served by ``hstu_compute`` (see docs/ARCHITECTURE.md).

Public API::

    HSTUConfig.load(model_dir)                       # config JSON next to the weights
    history_tokens(item_ids, action_ids, config)     # int64 [2n], the token contract
    check_request(item_ids, action_ids, candidate_ids, config) -> str | None
    PagedBatch.from_requests([(new_tokens, cached_len, page_row, candidate_ids), ...])
    plan_sub_batches([(queries, keys), ...]) -> [[request index, ...], ...]  # similar sizes together
    load_compiled(model_dir, device) / load_eager(model_dir, device) -> run(kv_pool, batch) -> scores
    load_reference(repo_dir).score(user_id, item_ids, action_ids, candidate_ids) -> np.ndarray
    fingerprint(model_dir) -> str                    # the KV namespace
    build(model_dir, device, force) -> Path          # the AOTI package (``hstu-build``)
"""

from compute.batch import PagedBatch, plan_sub_batches
from compute.build import build
from compute.checkpoint import fingerprint
from compute.config import HSTUConfig
from compute.reference import default_tolerance, load_reference
from compute.runtime import load_compiled, load_eager
from compute.tokens import check_request, history_tokens, history_tokens_many

__all__ = [
    "HSTUConfig",
    "PagedBatch",
    "build",
    "check_request",
    "fingerprint",
    "history_tokens",
    "history_tokens_many",
    "load_compiled",
    "load_eager",
    "default_tolerance",
    "load_reference",
    "plan_sub_batches",
]
