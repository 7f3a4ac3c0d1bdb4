"""Every tensor that crosses a model boundary, written once.

Used by the config generator (`deploy/make_configs.py` writes `model_repository/*/config.pbtxt`),
by the models' request validators and by the clients. The public interface is the ensemble's
(README, "Call it"); the rest are the ensemble's internal hops.

    client -> hstu_ranking (max_batch_size 0: the public shapes below, no batch dimension)
      kv_lookup_alloc (batched, one instance): ENSEMBLE_INPUTS -> LOOKUP_OUTPUTS
      hstu_compute    (batched): LOOKUP_OUTPUTS -> COMPUTE_OUTPUTS
      kv_offload      (batched): COMPUTE_OUTPUTS + kv_lookup_alloc's plan (its lease id) + item/action ids -> scores
    client -> hstu_monolithic: ENSEMBLE_INPUTS -> scores in one call

The three steps are batched models (max_batch_size > 0, dynamic batching, ragged inputs; the
lifecycle steps take one request per execute by default, see deploy/make_configs.py) although the
ensemble is not: Triton gives a batched step each request of the unbatched ensemble as a batch
of one (a leading dimension of 1 on every tensor) and strips that dimension from the step's
outputs that the ensemble returns, so the public shapes stay as they are.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Ends the message of an error the client may resend unchanged: nothing about the request was
# wrong and it changed no state (a new hstu_compute version loaded while it was in flight).
RETRYABLE = "[retryable]"

ENSEMBLE = "hstu_ranking"
MONOLITHIC = "hstu_monolithic"
LOOKUP = "kv_lookup_alloc"
COMPUTE = "hstu_compute"
OFFLOAD = "kv_offload"


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # Triton datatype name, e.g. "INT64"
    dims: tuple[int, ...]  # -1 = variable; excludes the batch dim of batched models
    ragged: bool = False  # allow_ragged_batch in a batched model


def scores_spec(num_tasks: int) -> TensorSpec:
    return TensorSpec("scores", "FP32", (-1, num_tasks))


ENSEMBLE_INPUTS = (
    TensorSpec("user_id", "INT64", (1,)),
    TensorSpec("item_ids", "INT64", (-1,), ragged=True),
    TensorSpec("action_ids", "INT64", (-1,), ragged=True),
    TensorSpec("candidate_ids", "INT64", (-1,), ragged=True),
)

# kv_lookup_alloc -> hstu_compute and kv_offload: one request's plan as one int64 tensor
# (deploy/runtime/compute_plan.py: cached and onboarded lengths, namespace tag, lease id, the new
# tokens, the page row and the candidates). Shape as the batched model sees it (batch dim excluded).
COMPUTE_PLAN = TensorSpec("compute_plan", "INT64", (-1,), ragged=True)
LOOKUP_OUTPUTS = (COMPUTE_PLAN,)


def compute_outputs(num_tasks: int) -> tuple[TensorSpec, ...]:
    """hstu_compute -> kv_offload ([1, c, num_tasks] per request)."""
    return (TensorSpec("candidate_scores", "FP32", (-1, num_tasks), ragged=True),)


# kv_offload also takes the public history inputs, straight from the ensemble's inputs: the host
# store's put is keyed by the prefix's token ids (it hashes them itself), so the offload needs
# them, and Triton hands them over without a copy through the owner.
OFFLOAD_HISTORY_INPUTS = ENSEMBLE_INPUTS[1:3]


@dataclass(frozen=True)
class RankingRequest:
    """One user's request as the clients build it (validated server-side again)."""

    user_id: int
    item_ids: list[int]
    action_ids: list[int]
    candidate_ids: list[int]

    def arrays(self) -> dict[str, np.ndarray]:
        return {
            "user_id": np.asarray([self.user_id], dtype=np.int64),
            "item_ids": np.asarray(self.item_ids, dtype=np.int64),
            "action_ids": np.asarray(self.action_ids, dtype=np.int64),
            "candidate_ids": np.asarray(self.candidate_ids, dtype=np.int64),
        }

    @classmethod
    def from_json(cls, obj: dict) -> "RankingRequest":
        return cls(int(obj["user_id"]), list(obj["item_ids"]), list(obj["action_ids"]),
                   list(obj["candidate_ids"]))

    def to_json(self) -> dict:
        return {"user_id": self.user_id, "item_ids": self.item_ids, "action_ids": self.action_ids,
                "candidate_ids": self.candidate_ids}
