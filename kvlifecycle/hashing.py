"""Content addressing of KV pages: a seeded hash chain over the token ids of a prefix.

Invariant 2 of docs/ARCHITECTURE.md: a page's key depends on every token before it and on the namespace
(a fingerprint of the model weights and config), so a rewritten history or reloaded weights
never match a stale page.

Definition (stable across processes, hosts and Python versions)::

    H(x)   = BLAKE2b with a 16-byte digest (hashlib.blake2b(x, digest_size=16))
    SEED   = b"kvlifecycle.page-chain.v1"
    key_-1 = ROOT_KEY = 16 zero bytes
    key_i  = H(SEED || key_{i-1} || u32_le(len(ns)) || ns || tokens_i)

where ``ns`` is the namespace as UTF-8 bytes (length-prefixed so that namespace and token
bytes cannot be confused) and ``tokens_i`` are the ``page_size`` token ids of page ``i`` as
little-endian int64. Only full pages have keys; a partial last page is never cached.
Python's builtin ``hash()`` is never used: it is salted per process.

Operations:
- ``page_keys(token_ids, namespace, page_size)``: keys of every full page of a prefix.
- ``namespace_tag(namespace)``: the namespace as one int64, for a tensor that carries a lease's
  namespace between processes (the compute checks it against its own). Memoized.
- ``PrefixKeys``: ``page_keys`` for a process that sees each user's history again and again
  (the cache owner): it keeps every user's last keys, so a request hashes only the pages its
  history added. The keys are the same bytes ``page_keys`` gives.
Both the device page table (``kvlifecycle.manager``) and the host store key pages with these
functions, so a key means the same page everywhere.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import struct
import threading
from collections import OrderedDict
from typing import Sequence, Union

import numpy as np
import torch

logger = logging.getLogger(__name__)

__all__ = ["KEY_BYTES", "ROOT_KEY", "SEED", "PrefixKeys", "TokenIds", "namespace_tag", "page_keys",
           "tokens_as_int64"]

KEY_BYTES = 16
SEED = b"kvlifecycle.page-chain.v1"
ROOT_KEY = bytes(KEY_BYTES)

TokenIds = Union[Sequence[int], np.ndarray, torch.Tensor]


def page_keys(token_ids: TokenIds, namespace: str | bytes, page_size: int) -> list[bytes]:
    """Keys of the full pages of ``token_ids``: ``len(token_ids) // page_size`` keys of
    ``KEY_BYTES`` bytes each, key ``i`` covering tokens ``[0, (i + 1) * page_size)``."""
    if page_size <= 0:
        raise ValueError(f"page_keys: expected page_size > 0, got {page_size}")
    return _extend([], tokens_as_int64(token_ids), _namespace_bytes(namespace), page_size)


class PrefixKeys:
    """``page_keys`` that remembers each user's last history and its keys (LRU over users, at
    most ``max_tokens`` token ids kept in all), so a user whose history grew hashes only its new
    full pages: the pages it shares with the last request (compared token by token, a memcmp)
    keep their keys. A rewritten history shares only the pages before its first change.
    Thread-safe."""

    def __init__(self, page_size: int, max_tokens: int = 1 << 23) -> None:
        if page_size <= 0 or max_tokens < 0:
            raise ValueError(f"PrefixKeys: expected page_size > 0 and max_tokens >= 0, got {page_size}, {max_tokens}")
        self.page_size = page_size
        self.max_tokens = max_tokens
        self._users: OrderedDict[tuple[int, str], tuple[np.ndarray, tuple[bytes, ...]]] = OrderedDict()
        self._tokens = 0  # token ids kept in _users
        self._lock = threading.Lock()

    def keys(self, user_id: int, token_ids: TokenIds, namespace: str) -> tuple[bytes, ...]:
        """``page_keys(token_ids, namespace, page_size)``, reusing ``user_id``'s last keys."""
        S = self.page_size
        tokens = tokens_as_int64(token_ids)
        full = tokens[: tokens.size // S * S]
        slot = (int(user_id), namespace)
        with self._lock:
            last = self._users.get(slot)
        if last is None:
            keys = tuple(_extend([], full, _namespace_bytes(namespace), S))
        else:
            last_tokens, last_keys = last
            if last_tokens.size == full.size and np.array_equal(last_tokens, full):
                return last_keys  # the same full pages again (allocate after lookup, a repeated request)
            n = min(last_tokens.size, full.size)
            differ = np.flatnonzero(last_tokens[:n] != full[:n])
            shared = (int(differ[0]) if differ.size else n) // S
            keys = tuple(_extend(list(last_keys[:shared]), full, _namespace_bytes(namespace), S))
        if full.size <= self.max_tokens:
            self._remember(slot, full.copy(), keys)
        return keys

    def _remember(self, slot: tuple[int, str], tokens: np.ndarray, keys: tuple[bytes, ...]) -> None:
        with self._lock:
            old = self._users.pop(slot, None)
            if old is not None:
                self._tokens -= old[0].size
            self._users[slot] = (tokens, keys)
            self._tokens += tokens.size
            while self._tokens > self.max_tokens:
                _, (dropped, _) = self._users.popitem(last=False)
                self._tokens -= dropped.size


def tokens_as_int64(token_ids: TokenIds) -> np.ndarray:
    """A 1-D int64 numpy view or copy of ``token_ids`` (list, numpy array or CPU tensor)."""
    if isinstance(token_ids, np.ndarray) and token_ids.dtype == np.int64:
        array = token_ids  # the serving path's case: no conversion at all
    elif isinstance(token_ids, torch.Tensor):
        array = token_ids.detach().to("cpu", torch.int64).numpy()
    else:
        array = np.asarray(token_ids, dtype=np.int64)
    if array.ndim != 1:
        raise ValueError(f"token ids: expected a 1-D sequence, got shape {tuple(array.shape)}")
    return array


# ---------------------------------------------------------------------------------------
# helpers


def _extend(keys: list[bytes], tokens: np.ndarray, ns_prefixed: bytes, page_size: int) -> list[bytes]:
    """``keys`` (the chain of the first ``len(keys)`` pages of ``tokens``) continued over every
    further full page of ``tokens``; a new list."""
    keys = list(keys)
    num_full = tokens.size // page_size
    data = tokens[len(keys) * page_size: num_full * page_size].astype("<i8", copy=False).tobytes()
    step = page_size * 8
    parent = keys[-1] if keys else ROOT_KEY
    for i in range(num_full - len(keys)):
        parent = _chain(parent, ns_prefixed, data[i * step:(i + 1) * step])
        keys.append(parent)
    return keys


def _namespace_bytes(namespace: str | bytes) -> bytes:
    ns = namespace.encode("utf-8") if isinstance(namespace, str) else bytes(namespace)
    return struct.pack("<I", len(ns)) + ns


def _chain(parent: bytes, ns_prefixed: bytes, page_bytes: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=KEY_BYTES)
    h.update(SEED)
    h.update(parent)
    h.update(ns_prefixed)
    h.update(page_bytes)
    return h.digest()


@functools.lru_cache(maxsize=64)
def namespace_tag(namespace: str) -> int:
    """A non-negative int64 naming ``namespace``: 60 bits of its BLAKE2b digest (two namespaces
    share a tag with probability 2**-60)."""
    digest = hashlib.blake2b(namespace.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 4
