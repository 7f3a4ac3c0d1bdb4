"""The HSTU model's configuration: one dataclass, saved as ``hstu_config.json`` next to the weights.

Operations:
- ``HSTUConfig(...)``: checks every field in ``__post_init__`` and raises ``ValueError`` naming it.
- ``HSTUConfig.load(path)``: reads a JSON file, or ``<dir>/hstu_config.json`` for a folder.
- ``config.save(path)``: writes the same JSON (sorted keys, so equal configs give equal bytes).
- ``config.to_json()``: the canonical JSON text, also hashed into the model fingerprint.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from compute.files import replace_atomically

logger = logging.getLogger(__name__)

__all__ = ["CONFIG_FILENAME", "DTYPES", "HSTUConfig"]

CONFIG_FILENAME = "hstu_config.json"
# The shipped model: hstu_compute's version folder in the model repository (hstu-build's and the
# serving settings' default).
DEFAULT_MODEL_DIR = Path(__file__).resolve().parent.parent / "model_repository" / "hstu_compute" / "1"
DTYPES = ("float32", "bfloat16", "float16")  # torch dtype names the model runs in


@dataclass(frozen=True)
class HSTUConfig:
    """Geometry of the HSTU ranking model. The defaults serve on a 2-core CPU.

    Token space (ARCHITECTURE.md): item tokens are item ids ``1..item_vocab-1`` (0 is padding),
    action tokens are ``item_vocab + action_id`` with ``action_id`` in ``0..action_vocab-1``.
    A history of ``n <= max_history_events`` events is ``2n`` tokens.
    """

    item_vocab: int = 100_000
    action_vocab: int = 16
    max_history_events: int = 2048
    max_candidates: int = 256
    page_size: int = 32  # tokens per KV page; even, so pages end between events
    num_layers: int = 2
    num_heads: int = 2
    head_dim: int = 32  # per head, for Q, K and V (what the page pool stores)
    hidden_dim: int = 64  # width of the residual stream and the embeddings
    num_tasks: int = 3
    dtype: str = "float32"
    seed: int = 0  # seeds the random initialisation written when no checkpoint exists

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            expected = str if f.name == "dtype" else int
            if type(value) is not expected:
                raise ValueError(f"HSTUConfig.{f.name}: expected {expected.__name__}, got {value!r}")
        minimum = {"item_vocab": 2, "action_vocab": 1, "max_history_events": 1, "max_candidates": 1,
                   "page_size": 2, "num_layers": 1, "num_heads": 1, "head_dim": 1, "hidden_dim": 1,
                   "num_tasks": 1, "seed": 0}
        for name, low in minimum.items():
            if getattr(self, name) < low:
                raise ValueError(f"HSTUConfig.{name}: expected >= {low}, got {getattr(self, name)}")
        # The one place of this rule: kvlifecycle pages any number of tokens, and every served
        # pool is built from this config.
        if self.page_size % 2 != 0:
            raise ValueError(f"HSTUConfig.page_size: expected an even number of tokens (an event is two "
                             f"tokens, so a page boundary falls between events), got {self.page_size}")
        if self.dtype not in DTYPES:
            raise ValueError(f"HSTUConfig.dtype: expected one of {sorted(DTYPES)}, got {self.dtype!r}")

    @property
    def vocab_size(self) -> int:
        """Size of the token space: item tokens then action tokens."""
        return self.item_vocab + self.action_vocab

    @property
    def max_history_tokens(self) -> int:
        """Longest history in tokens (two per event)."""
        return 2 * self.max_history_events

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def serving_mismatch(self, other: "HSTUConfig") -> list[str]:
        """The fields in which ``other`` cannot serve beside this config: the request limits and
        the KV geometry (one page pool and one validation serve every model version). Width,
        depth of the MLPs, weights and seed may differ: they change the KV namespace only."""
        fields = ("item_vocab", "action_vocab", "max_history_events", "max_candidates", "page_size",
                  "num_layers", "num_heads", "head_dim", "num_tasks", "dtype")
        return [f"{name}: {getattr(self, name)} vs {getattr(other, name)}"
                for name in fields if getattr(self, name) != getattr(other, name)]

    def to_json(self) -> str:
        """Canonical JSON (sorted keys, fixed separators): equal configs give equal text."""
        return json.dumps(dataclasses.asdict(self), sort_keys=True, indent=2) + "\n"

    def save(self, path: str | os.PathLike) -> Path:
        """Writes ``to_json()`` to ``path`` (or ``path/hstu_config.json`` for a folder), atomically."""
        target = _config_path(path)
        replace_atomically(target, lambda tmp: tmp.write_text(self.to_json()))
        return target

    @classmethod
    def load(cls, path: str | os.PathLike) -> "HSTUConfig":
        """Reads a config file, or ``path/hstu_config.json`` when ``path`` is a folder.
        Unknown keys are an error (a typo must not silently fall back to a default)."""
        source = _config_path(path)
        data = json.loads(source.read_text())
        if not isinstance(data, dict):
            raise ValueError(f"{source}: expected a JSON object, got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"{source}: unknown HSTUConfig field(s) {unknown}; known: {sorted(known)}")
        return cls(**data)


# ---------------------------------------------------------------------------------------
# helpers


def _config_path(path: str | os.PathLike) -> Path:
    p = Path(path)
    return p / CONFIG_FILENAME if p.is_dir() else p
