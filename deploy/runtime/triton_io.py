"""Tensor in/out and error responses for the Python-backend models (imported only inside Triton).

Tensors cross model boundaries by DLPack in both directions: it is zero-copy on the GPU and
works with numpy 1 and 2 (the stub's numpy conversions break with numpy 2, seen on the GPU host).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import triton_python_backend_utils as pb_utils

from compute.tokens import check_request, ids_in_range, looks_corrupted_in_transit  # the one place that knows the id rules
from deploy.runtime.schema import ENSEMBLE_INPUTS, RETRYABLE

logger = logging.getLogger(__name__)


class BadRequest(ValueError):
    """A request the client must fix; it becomes an error response and changes no state.
    `retryable`: the ids look corrupted in transit (`compute.tokens.looks_corrupted_in_transit`)."""

    def __init__(self, message: str, retryable: bool = False) -> None:
        super().__init__(message)
        self.retryable = retryable

    def response(self) -> "pb_utils.InferenceResponse":
        return error_response(str(self), retryable=self.retryable)


def input_tensor(request, name: str) -> torch.Tensor:
    """The input as a tensor of this process's own memory (the inputs are small). A zero-copy
    DLPack view points into the stub's shared memory; the 5-minute soak once read an item id with
    2**32 added (1 request in about 150,000, the lifecycle models batching, the metrics thread
    messaging through that memory). Suspected: a view outliving its buffer; a copy rules it out."""
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        raise BadRequest(f"missing input '{name}'")
    return torch.from_dlpack(tensor.to_dlpack()).clone()


def input_tensors(request, names: tuple[str, ...], views: tuple[str, ...] = ()) -> list[torch.Tensor]:
    """``input_tensor`` of each of ``names``, then a zero-copy view of each of ``views``, the
    request's inputs listed once (each ``get_input_tensor_by_name`` lists them all again). A view
    is valid only while `execute` runs: for reading a few values at once (kv_offload reads one
    value of a whole plan), never to keep."""
    given = {tensor.name(): tensor for tensor in request.inputs()}
    missing = [name for name in (*names, *views) if name not in given]
    if missing:
        raise BadRequest(f"missing input '{missing[0]}'")
    return ([torch.from_dlpack(given[name].to_dlpack()).clone() for name in names]
            + [torch.from_dlpack(given[name].to_dlpack()) for name in views])


def output_tensor(name: str, value: torch.Tensor) -> "pb_utils.Tensor":
    return pb_utils.Tensor.from_dlpack(name, torch.utils.dlpack.to_dlpack(value.contiguous()))


class Reply:
    """A request's answer, for the list `execute` returns. Answered once: a later answer (an
    error for a request another thread answered meanwhile) is ignored."""

    def __init__(self) -> None:
        self.response = None

    def answer(self, response) -> None:
        if self.response is None:
            self.response = response


def error_response(message: str, retryable: bool = False) -> "pb_utils.InferenceResponse":
    """An error for one request. `retryable`: nothing about the request is wrong and it changed
    no state, so resending it succeeds (code UNAVAILABLE, message ending in RETRYABLE)."""
    if retryable:
        error = pb_utils.TritonError(f"{message} {RETRYABLE}", pb_utils.TritonError.UNAVAILABLE)
    else:
        error = pb_utils.TritonError(message)
    return pb_utils.InferenceResponse(output_tensors=[], error=error)


RANKING_INPUTS = tuple(spec.name for spec in ENSEMBLE_INPUTS)  # user_id, item_ids, action_ids, candidate_ids


@dataclass
class RankingInputs:
    """One user's request, validated: ids in range, lengths consistent, sizes within limits."""

    user_id: int
    item_ids: torch.Tensor  # int64 [n]
    action_ids: torch.Tensor  # int64 [n]
    candidate_ids: torch.Tensor  # int64 [c]


def read_ranking_request(request, config) -> RankingInputs:
    """Parse and validate the ensemble's public inputs; raise BadRequest naming the field."""
    result = read_ranking_batch([request], config)[0]
    if isinstance(result, BadRequest):
        raise result
    return result


def read_ranking_batch(requests: list, config) -> list["RankingInputs | BadRequest"]:
    """`read_ranking_request` of each request, with the id ranges of the whole batch checked in
    one pass (one min/max per field over the batch's ids); a request's exact message is looked
    for only when that pass finds a bad id. Per request: its inputs, or the BadRequest naming
    the field to fix."""
    out: list[RankingInputs | BadRequest] = []
    for request in requests:
        try:
            user, items, actions, candidates = (t.reshape(-1) for t in input_tensors(request, RANKING_INPUTS))
            if user.numel() != 1:
                raise BadRequest(f"user_id: expected shape [1], got {list(user.shape)}")
            r = RankingInputs(int(user.item()), items, actions, candidates)
            n, c = items.numel(), candidates.numel()
            # every rule but the id ranges: cheap per request
            if (actions.numel() != n or n > config.max_history_events or not 1 <= c <= config.max_candidates
                    or any(t.dtype != torch.int64 for t in (items, actions, candidates))):
                raise BadRequest(check_request(items, actions, candidates, config))
            out.append(r)
        except BadRequest as e:
            out.append(e)
    good = [r for r in out if isinstance(r, RankingInputs)]
    if good and not _ids_in_range(good, config):
        out = [r if not isinstance(r, RankingInputs) else _checked(r, config) for r in out]
    return out


def _ids_in_range(batch: list[RankingInputs], config) -> bool:
    return (ids_in_range([r.item_ids for r in batch], 1, config.item_vocab)
            and ids_in_range([r.action_ids for r in batch], 0, config.action_vocab)
            and ids_in_range([r.candidate_ids for r in batch], 1, config.item_vocab))


def _checked(r: RankingInputs, config) -> "RankingInputs | BadRequest":
    problem = check_request(r.item_ids, r.action_ids, r.candidate_ids, config)
    if problem is None:
        return r
    if looks_corrupted_in_transit(r.item_ids, r.action_ids, r.candidate_ids, config):
        return BadRequest(f"{problem}: an id in range with its upper 32 bits set, as tritonserver 2.51's Python "
                          "backend corrupts a batched input now and then; resend the request", retryable=True)
    return BadRequest(problem)
