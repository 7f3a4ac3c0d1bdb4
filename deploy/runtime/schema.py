"""Every tensor that crosses a model boundary, written once.

Used by the config generator (`deploy/make_configs.py` writes `model_repository/*/config.pbtxt`),
by the models' request validators and by the clients. The public interface is the ensemble's
(README, "Call it"); the rest are the ensemble's internal hops.

    client -> hstu_ranking
      kv_lookup_alloc (max_batch_size 0, one instance): ENSEMBLE_INPUTS -> LOOKUP_OUTPUTS
      hstu_compute    (max_batch_size > 0, dynamic batching, ragged): LOOKUP_OUTPUTS -> COMPUTE_OUTPUTS
      kv_offload      (max_batch_size 0): COMPUTE_OUTPUTS + item/action ids -> scores
    client -> hstu_monolithic: ENSEMBLE_INPUTS -> ENSEMBLE_OUTPUTS in one call

kv_lookup_alloc's outputs carry a leading dimension of 1: it is the batch dimension of the
batched hstu_compute: Triton requires it of a `max_batch_size: 0` step feeding a batched one.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

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
    TensorSpec("item_ids", "INT64", (-1,)),
    TensorSpec("action_ids", "INT64", (-1,)),
    TensorSpec("candidate_ids", "INT64", (-1,)),
)

# kv_lookup_alloc -> hstu_compute. Shapes as the batched model sees them (batch dim excluded).
LOOKUP_OUTPUTS = (
    TensorSpec("new_tokens", "INT64", (-1,), ragged=True),  # history tokens to compute
    TensorSpec("cached_len", "INT64", (1,)),  # tokens already in the pool (page multiple)
    TensorSpec("page_row", "INT64", (-1,), ragged=True),  # pages covering cached + new tokens
    TensorSpec("candidates", "INT64", (-1,), ragged=True),
    TensorSpec("lease_id", "INT64", (1,)),
)


def compute_outputs(num_tasks: int) -> tuple[TensorSpec, ...]:
    """hstu_compute -> kv_offload (batched: [1, c, num_tasks] and [1, 1] per request)."""
    return (
        TensorSpec("candidate_scores", "FP32", (-1, num_tasks)),
        TensorSpec("done_lease_id", "INT64", (1,)),
    )

# kv_offload also takes the public history inputs, straight from the ensemble's inputs.
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
