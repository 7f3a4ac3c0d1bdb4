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

import numpy as np
import torch

_MODULUS = 1 << 24  # float32 holds every integer below it exactly


def seal(scores: torch.Tensor) -> torch.Tensor:
    """``[c, num_tasks]`` float32 scores -> ``[c + 1, num_tasks]`` with the checksum row."""
    return seal_batch(scores, [scores.shape[0]])[0]


def seal_batch(scores: torch.Tensor, counts: list[int]) -> list[torch.Tensor]:
    """``seal`` of each request's rows of a batch's ``[sum c, num_tasks]`` float32 host scores
    (``counts``: each request's c, in order), for the whole batch at once in numpy (a torch op
    per request costs more in dispatch than the rows' copy; torch's indexed writes woke its
    thread pool on the GPU host)."""
    rows = scores.contiguous().numpy()
    sizes = np.asarray(counts, dtype=np.int64)
    ends = np.cumsum(sizes)
    # each request's checksum: a prefix sum of the rows' bit-pattern sums, read at its bounds
    bits = np.concatenate([[0], _bit_patterns(rows).sum(axis=1).cumsum()])
    sealed = np.zeros((rows.shape[0] + len(counts), rows.shape[1]), dtype=np.float32)
    check_rows = ends + np.arange(len(counts))  # request b's rows, then its check row, then b + 1's
    sealed[np.arange(rows.shape[0]) + np.repeat(np.arange(len(counts)), sizes)] = rows
    sealed[check_rows, 0] = (bits[ends] - bits[ends - sizes]) % _MODULUS
    if rows.shape[1] > 1:
        sealed[check_rows, 1] = sizes
    sealed_tensor = torch.from_numpy(sealed)
    return [sealed_tensor[end - size:end + 1] for end, size in zip(check_rows.tolist(), counts)]


def unseal(sealed: torch.Tensor) -> torch.Tensor | None:
    """The scores of ``seal``'s output, or None when they do not match their checksum row.
    Read in numpy (a few torch ops per request cost more than the check itself)."""
    rows = sealed.contiguous().numpy()
    scores, check = rows[:-1], rows[-1]
    if scores.shape[1] > 1 and check[1] != scores.shape[0]:
        return None
    return sealed[:-1] if check[0] == _checksum(scores) else None


def _checksum(scores: np.ndarray) -> int:
    return int(_bit_patterns(scores).sum()) % _MODULUS


def _bit_patterns(scores: np.ndarray) -> np.ndarray:
    """The float32 scores' bit patterns as int64 (what seal and unseal sum)."""
    return scores.view(np.int32).astype(np.int64)
