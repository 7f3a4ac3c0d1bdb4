"""Test fault injection for the Triton models. Off unless the `HSTU_FAULTS` environment variable is set.

Only the reliability tests set it (through `LaunchConfig.extra_env`); a deployment never does.
The value is a JSON object naming the faults to inject:

    HSTU_FAULTS='{"compute_raise_on_candidate": 99991}'

Faults:
- `compute_raise_on_candidate: int`: hstu_compute raises `InjectedFault` while scoring any batch
  holding a request with this candidate id, so that request fails (and the rest of its batch is
  retried without it).

Cost when off: each model asks once, in `initialize`, for its hook (`compute_fault()`), gets None
and only tests `hook is not None` per batch. An unknown key or a malformed value raises at model
load, so a typo never silently disables a test's fault.
"""
from __future__ import annotations

import json
import os
from typing import Callable, Sequence

import torch

ENV = "HSTU_FAULTS"
_KNOWN = {"compute_raise_on_candidate": int}


class InjectedFault(RuntimeError):
    """A failure injected on purpose by a test through `HSTU_FAULTS`."""


def compute_fault(env: dict[str, str] | None = None) -> Callable[[Sequence[torch.Tensor]], None] | None:
    """hstu_compute's hook: called with each request's candidate ids before the batch is scored;
    raises `InjectedFault` when one holds the trigger. None when this fault is off."""
    trigger = _faults(env).get("compute_raise_on_candidate")
    if trigger is None:
        return None

    def raise_on_trigger(candidates: Sequence[torch.Tensor]) -> None:
        for i, ids in enumerate(candidates):
            if bool((ids == trigger).any()):
                raise InjectedFault(f"injected fault (test): candidate {trigger} in request {i} of the batch")

    return raise_on_trigger


# ---- helpers ------------------------------------------------------------------------------------

def _faults(env: dict[str, str] | None) -> dict[str, object]:
    raw = (os.environ if env is None else env).get(ENV, "").strip()
    if not raw:
        return {}
    try:
        spec = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ValueError(f"{ENV}={raw!r}: expected a JSON object ({e})") from e
    if not isinstance(spec, dict):
        raise ValueError(f"{ENV}={raw!r}: expected a JSON object, got {type(spec).__name__}")
    for key, value in spec.items():
        kind = _KNOWN.get(key)
        if kind is None:
            raise ValueError(f"{ENV}: unknown fault {key!r}; known: {sorted(_KNOWN)}")
        if not isinstance(value, kind) or isinstance(value, bool):
            raise ValueError(f"{ENV}: {key} expected {kind.__name__}, got {value!r}")
    return spec
