"""What kv_lookup_alloc tells hstu_compute (and kv_offload) about one request, as one tensor.

Seven small tensors cost the Python backend a shared-memory buffer and a DLPack round trip each,
on the way out of kv_lookup_alloc and again into hstu_compute: about 0.05 ms apiece on the CPU
machine, at every request. So a request's plan travels as one int64 tensor:

    [cached_len, onboard_len, namespace_tag, lease_id, num_new_tokens, num_pages, num_onboard_keys,
     new_tokens (num_new_tokens), page_row (num_pages), onboard_keys (2 * num_onboard_keys),
     candidates (the rest)]

`ComputePlan.pack` writes it; `ComputePlan.unpack` reads it back, checking its lengths.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

HEADER = 7  # cached_len, onboard_len, namespace_tag, lease_id, num_new_tokens, num_pages, num_onboard_keys
NO_KEYS = torch.zeros((0, 2), dtype=torch.int64)  # a plan without onboard keys (read only)


class ComputePlan(NamedTuple):
    """One request as hstu_compute computes it."""

    new_tokens: torch.Tensor  # int64 [n]: history tokens from cached_len - onboard_len on
    cached_len: int  # tokens cached in the pool once the onboard is done (a page multiple)
    onboard_len: int  # the last onboard_len cached tokens are being copied in (0: none)
    page_row: torch.Tensor  # int64 [pages]: pages covering the cached and the new tokens
    candidates: torch.Tensor  # int64 [c]
    namespace_tag: int  # the lease's KV namespace (kvlifecycle.hashing.namespace_tag)
    lease_id: int  # the request's lease in the owner
    # int64 [onboard pages, 2]: the onboard pages' keys when hstu_compute copies them from the
    # store's shared slab itself (kvlifecycle.store.slab); none when the owner settles the onboard
    onboard_keys: torch.Tensor = NO_KEYS

    def pack(self) -> torch.Tensor:
        # numpy views and one concatenate: half the cost of torch's per-op dispatch (kv_lookup_alloc
        # packs every request's plan; 11 -> 6 us each on the CPU machine)
        new_tokens, page_row = self.new_tokens.numpy(), self.page_row.numpy()
        onboard_keys, candidates = self.onboard_keys.numpy(), self.candidates.numpy()
        header = np.array((self.cached_len, self.onboard_len, self.namespace_tag, self.lease_id, new_tokens.size,
                           page_row.size, len(onboard_keys)), dtype=np.int64)
        return torch.from_numpy(np.concatenate([header, new_tokens.ravel(), page_row.ravel(), onboard_keys.ravel(),
                                                candidates.ravel()]))

    @classmethod
    def unpack(cls, flat: torch.Tensor) -> "ComputePlan":
        """Raises ``ValueError`` when ``flat`` is not a plan (a bug upstream, never a client's)."""
        values = flat.numpy().reshape(-1)  # sliced in numpy: a fraction of torch's per-op cost
        if values.size < HEADER:
            raise ValueError(f"compute_plan: expected at least {HEADER} values, got {values.size}")
        cached_len, onboard_len, tag, lease_id, n, p, k = values[:HEADER].tolist()
        if n < 0 or p < 0 or k < 0 or HEADER + n + p + 2 * k > values.size:
            raise ValueError(f"compute_plan: {n} new tokens, {p} pages and {k} onboard keys do not fit in "
                             f"{values.size} values")
        if not 0 <= onboard_len <= cached_len:  # the owner writes onboard_len <= cached_len, both >= 0
            raise ValueError(f"compute_plan: onboard_len {onboard_len} outside [0, cached_len {cached_len}]")
        new_end, row_end, keys_end = HEADER + n, HEADER + n + p, HEADER + n + p + 2 * k
        return cls(new_tokens=torch.from_numpy(values[HEADER:new_end]), cached_len=cached_len,
                   onboard_len=onboard_len, page_row=torch.from_numpy(values[new_end:row_end]),
                   candidates=torch.from_numpy(values[keys_end:]), namespace_tag=tag, lease_id=lease_id,
                   onboard_keys=torch.from_numpy(values[row_end:keys_end]).reshape(k, 2))

    def after_onboard(self, copied: int, page_row: torch.Tensor | None = None) -> "ComputePlan":
        """The plan once its onboard ended with the first ``copied`` onboard tokens in the pool
        (on ``page_row``: a quarantine moves the lease); the tokens not copied are computed."""
        assert 0 <= copied <= self.onboard_len, f"after_onboard: copied {copied} of {self.onboard_len} onboard tokens"
        return self._replace(new_tokens=self.new_tokens[copied:], cached_len=self.cached_len - self.onboard_len + copied,
                             onboard_len=0, onboard_keys=NO_KEYS, page_row=self.page_row if page_row is None else page_row)

    @staticmethod
    def lease_id_of(flat: torch.Tensor) -> int:
        """The lease id alone (kv_offload reads nothing else)."""
        return int(flat.reshape(-1)[3])
