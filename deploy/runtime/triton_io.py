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
    """A request of an `execute` until it is answered, exactly once (a later `answer` is a no-op).

    Answered on `execute`'s thread, its response is kept and `execute` returns it
    (`Pending.returned`): the stub hands the batch's responses to the server with the message
    that ends `execute`. A request another thread will answer is `hand_over()`-ed first, on
    `execute`'s thread: its answer then goes through its response sender, a synchronous round
    trip to the server per send (in kv_lookup_alloc, sending every answer that way took 43% of
    `execute`), and `execute` returns None in its place (the Python backend allows both in one
    batch)."""

    def __init__(self, request, model: str) -> None:
        self.request = request
        self.model = model
        self.answered = False
        self.response = None  # kept for execute's return value
        self._sender = None  # set by hand_over

    def hand_over(self) -> None:
        """From now on `answer` sends, from any thread; call it before another thread may answer."""
        self._sender = self.request.get_response_sender()

    def answer(self, response) -> None:
        if self.answered:
            return
        self.answered = True
        if self._sender is None:
            self.response = response
            return
        try:
            self._sender.send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        except Exception:  # the client is gone, or the server stops: nothing left to tell
            logger.warning("%s: a response could not be sent", self.model, exc_info=True)

    @staticmethod
    def returned(pending: list["Pending"]) -> list:
        """What `execute` returns for `pending`, in request order: each response, None for a
        request handed over. One neither answered nor handed over (a bug) gets an error, so that
        no request is left without an answer."""
        out = []
        for p in pending:
            if p._sender is None and not p.answered:
                logger.error("%s: a request was neither answered nor handed over", p.model)
                p.answer(error_response(f"{p.model}: internal error: the request was not answered"))
            out.append(None if p._sender is not None else p.response)
        return out


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
