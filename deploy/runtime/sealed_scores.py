"""The scores hstu_compute hands kv_offload, sealed with a checksum row.

tritonserver 2.51's Python backend now and then corrupts a batched model's input in shared
memory: a 4-byte word overwritten (docs/ARCHITECTURE.md, "Batching on tritonserver 2.51"). The
int64 tensors between the steps are range-checked where they are read, so a corrupted id, page
or lease fails loudly; a float score would not. So hstu_compute appends one row to a request's
scores, `[checksum, number of candidates, 0, ...]`, and kv_offload checks it before it answers:
a score that changed in transit is caught, and the request is answered with a retryable error.
The checksum is the sum of the scores' float32 bit patterns modulo 2**24 (exact in a float32):
any one changed word changes it, unless by a multiple of 2**24.
"""
from __future__ import annotations

import torch

_MODULUS = 1 << 24  # float32 holds every integer below it exactly


def seal(scores: torch.Tensor) -> torch.Tensor:
    """``[c, num_tasks]`` float32 scores -> ``[c + 1, num_tasks]`` with the checksum row."""
    check = torch.zeros(1, scores.shape[1], dtype=torch.float32)
    check[0, 0] = _checksum(scores)
    if scores.shape[1] > 1:
        check[0, 1] = scores.shape[0]
    return torch.cat([scores, check])


def unseal(sealed: torch.Tensor) -> torch.Tensor | None:
    """The scores of ``seal``'s output, or None when they do not match their checksum row."""
    scores, check = sealed[:-1], sealed[-1]
    if scores.shape[1] > 1 and check[1].item() != scores.shape[0]:
        return None
    return scores if check[0].item() == _checksum(scores) else None


def _checksum(scores: torch.Tensor) -> int:
    return int(scores.contiguous().view(torch.int32).to(torch.int64).sum()) % _MODULUS
