"""What kv_lookup_alloc tells hstu_compute (and kv_offload) about one request, as one tensor.

Seven small tensors cost the Python backend a shared-memory buffer and a DLPack round trip each,
on the way out of kv_lookup_alloc and again into hstu_compute: about 0.05 ms apiece on the CPU
machine, at every request. So a request's plan travels as one int64 tensor:

    [cached_len, onboard_len, namespace_tag, lease_id, num_new_tokens, num_pages,
     new_tokens (num_new_tokens), page_row (num_pages), candidates (the rest)]

`ComputePlan.pack` writes it; `ComputePlan.unpack` reads it back, checking its lengths.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

HEADER = 6  # cached_len, onboard_len, namespace_tag, lease_id, num_new_tokens, num_pages


class ComputePlan(NamedTuple):
    """One request as hstu_compute computes it."""

    new_tokens: torch.Tensor  # int64 [n]: history tokens from cached_len - onboard_len on
    cached_len: int  # tokens cached in the pool once the onboard is done (a page multiple)
    onboard_len: int  # the last onboard_len cached tokens are being copied in (0: none)
    page_row: torch.Tensor  # int64 [pages]: pages covering the cached and the new tokens
    candidates: torch.Tensor  # int64 [c]
    namespace_tag: int  # the lease's KV namespace (kvlifecycle.hashing.namespace_tag)
    lease_id: int  # the request's lease in the owner

    def pack(self) -> torch.Tensor:
        # numpy: one concatenate of small arrays costs a fraction of torch's per-op dispatch
        header = (self.cached_len, self.onboard_len, self.namespace_tag, self.lease_id, self.new_tokens.numel(),
                  self.page_row.numel())
        return torch.from_numpy(np.concatenate([np.asarray(header, dtype=np.int64), self.new_tokens.reshape(-1).numpy(),
                                                self.page_row.reshape(-1).numpy(), self.candidates.reshape(-1).numpy()]))

    @classmethod
    def unpack(cls, flat: torch.Tensor) -> "ComputePlan":
        """Raises ``ValueError`` when ``flat`` is not a plan (a bug upstream, never a client's)."""
        values = flat.numpy().reshape(-1)  # sliced in numpy: a fraction of torch's per-op cost
        if values.size < HEADER:
            raise ValueError(f"compute_plan: expected at least {HEADER} values, got {values.size}")
        cached_len, onboard_len, tag, lease_id, n, p = values[:HEADER].tolist()
        if n < 0 or p < 0 or HEADER + n + p > values.size:
            raise ValueError(f"compute_plan: {n} new tokens and {p} pages do not fit in {values.size} values")
        if not 0 <= onboard_len <= cached_len:  # the owner writes onboard_len <= cached_len, both >= 0
            raise ValueError(f"compute_plan: onboard_len {onboard_len} outside [0, cached_len {cached_len}]")
        new_end, row_end = HEADER + n, HEADER + n + p
        return cls(new_tokens=torch.from_numpy(values[HEADER:new_end]), cached_len=cached_len,
                   onboard_len=onboard_len, page_row=torch.from_numpy(values[new_end:row_end]),
                   candidates=torch.from_numpy(values[row_end:]), namespace_tag=tag, lease_id=lease_id)

    @staticmethod
    def lease_id_of(flat: torch.Tensor) -> int:
        """The lease id alone (kv_offload reads nothing else)."""
        return int(flat.reshape(-1)[3])
