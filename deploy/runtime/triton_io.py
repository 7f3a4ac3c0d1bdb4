"""Tensor in/out and error responses for the Python-backend models (imported only inside Triton).

Tensors cross model boundaries by DLPack in both directions: it is zero-copy on the GPU and
works with numpy 1 and 2 (the stub's numpy conversions break with numpy 2, seen on the GPU host).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import triton_python_backend_utils as pb_utils

from deploy.runtime.schema import RETRYABLE

logger = logging.getLogger(__name__)


class BadRequest(ValueError):
    """A request the client must fix; it becomes an error response and changes no state."""


def input_tensor(request, name: str) -> torch.Tensor:
    """The input as a tensor of this process's own memory (the inputs are small). A zero-copy
    DLPack view points into the stub's shared memory; the 5-minute soak once read an item id with
    2**32 added (1 request in about 150,000, the lifecycle models batching, the metrics thread
    messaging through that memory). Suspected: a view outliving its buffer; a copy rules it out."""
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        raise BadRequest(f"missing input '{name}'")
    return torch.from_dlpack(tensor.to_dlpack()).clone()


def output_tensor(name: str, value: torch.Tensor) -> "pb_utils.Tensor":
    return pb_utils.Tensor.from_dlpack(name, torch.utils.dlpack.to_dlpack(value.contiguous()))


class Pending:
    """A request until it is answered through its response sender. `answer` sends the one final
    response a non-decoupled model owes it; any later call is a no-op, so no path can answer a
    request twice. A model that answers this way returns None from `execute` (the Python backend
    allows it), and so can answer some requests after `execute` returned, from another thread."""

    def __init__(self, request, model: str) -> None:
        self.sender = request.get_response_sender()
        self.model = model
        self.answered = False

    def answer(self, response) -> None:
        if self.answered:
            return
        self.answered = True
        try:
            self.sender.send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        except Exception:  # the client is gone, or the server stops: nothing left to tell
            logger.warning("%s: a response could not be sent", self.model, exc_info=True)


def error_response(message: str, retryable: bool = False) -> "pb_utils.InferenceResponse":
    """An error for one request. `retryable`: nothing about the request is wrong and it changed
    no state, so resending it succeeds (code UNAVAILABLE, message ending in RETRYABLE)."""
    if retryable:
        error = pb_utils.TritonError(f"{message} {RETRYABLE}", pb_utils.TritonError.UNAVAILABLE)
    else:
        error = pb_utils.TritonError(message)
    return pb_utils.InferenceResponse(output_tensors=[], error=error)


@dataclass
class RankingInputs:
    """One user's request, validated: ids in range, lengths consistent, sizes within limits."""

    user_id: int
    item_ids: torch.Tensor  # int64 [n]
    action_ids: torch.Tensor  # int64 [n]
    candidate_ids: torch.Tensor  # int64 [c]


def read_ranking_request(request, config) -> RankingInputs:
    """Parse and validate the ensemble's public inputs; raise BadRequest naming the field."""
    from compute.tokens import check_request  # the one place that knows the id ranges

    user = input_tensor(request, "user_id").reshape(-1)
    if user.numel() != 1:
        raise BadRequest(f"user_id: expected shape [1], got {list(user.shape)}")
    items = input_tensor(request, "item_ids").reshape(-1)
    actions = input_tensor(request, "action_ids").reshape(-1)
    candidates = input_tensor(request, "candidate_ids").reshape(-1)
    problem = check_request(items, actions, candidates, config)
    if problem:
        raise BadRequest(problem)
    return RankingInputs(int(user.item()), items, actions, candidates)
