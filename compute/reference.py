"""The reference scorer: the project's oracle for invariant 1 of docs/ARCHITECTURE.md (cached == uncached).

``load_reference(repo_dir)`` loads the weights the server serves (``<repo_dir>/hstu_compute/1``,
or ``repo_dir`` itself when it holds ``hstu_config.json``) and returns a ``ReferenceScorer``,
whose ``score`` runs the stateless full forward (``HSTUModel.reference_scores``) in float32: no
pages, no cache, no batching. On the CPU by default; ``device="cuda"`` runs the same float32
forward on the GPU, where a benchmark checks thousands of requests.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np
import torch

from compute.checkpoint import load_model
from compute.config import CONFIG_FILENAME, HSTUConfig
from compute.tokens import Ids, check_request, history_tokens, ids_as_tensor

logger = logging.getLogger(__name__)

__all__ = ["BF16_TOLERANCE", "MODEL_SUBDIR", "ReferenceScorer", "default_tolerance", "load_reference", "resolve_model_dir"]

MODEL_SUBDIR = Path("hstu_compute") / "1"


class ReferenceScorer:
    """Scores one user's request with the full forward over the whole history."""

    def __init__(self, model_dir: str | os.PathLike, device: str = "cpu") -> None:
        self.model_dir = Path(model_dir)
        self.device = torch.device(device)
        self.model = load_model(self.model_dir, "cpu").float().to(self.device)
        self.config: HSTUConfig = self.model.config

    def score(self, user_id: int, item_ids: Ids, action_ids: Ids, candidate_ids: Ids) -> np.ndarray:
        """float32 [c, num_tasks] logits. ``user_id`` does not reach the model (no contextual
        tokens; see compute.model). Raises ``ValueError`` naming the field for a bad request."""
        error = check_request(item_ids, action_ids, candidate_ids, self.config)
        if error is not None:
            raise ValueError(error)
        tokens = history_tokens(item_ids, action_ids, self.config)  # [2n]
        candidates = ids_as_tensor(candidate_ids, "candidate_ids")  # [c]
        with torch.no_grad():
            scores = self.model.reference_scores(tokens.to(self.device), candidates.to(self.device))
        return scores.cpu().numpy()


def load_reference(repo_dir: str | os.PathLike = "model_repository", device: str = "cpu") -> ReferenceScorer:
    """The reference scorer over the model folder found from ``repo_dir`` (see module docstring)."""
    return ReferenceScorer(resolve_model_dir(repo_dir), device)


BF16_TOLERANCE = 2e-2


def default_tolerance(config: HSTUConfig) -> float:
    """The max abs diff a served score may have from this reference: float32 serving agrees to
    1e-4; bfloat16 or float16 compute, with its rounding over every layer, to ``BF16_TOLERANCE``.

    Why 2e-2 for bf16: served bf16 scores (magnitude about 0.5) have stayed within 7.2e-3 of this
    reference on both GPU configs over every checked request, so 2e-2 leaves about 3x for longer
    histories. What it can see: on the small GPU config's reference, a cached prefix of 256
    events that belongs to another history moves the scores by 8e-2 to 1e-1, half of it by
    3.5e-2 or more (tests/compute/test_compute_cuda.py proves it on the GPU), but one wrong page
    (16 events) only by about 1.2e-2 and one wrong event by 3e-3 to 3e-2: below what bf16
    rounding allows. Single-event sensitivity is proven on the float32 configs, at 1e-4."""
    return 1e-4 if config.dtype == "float32" else BF16_TOLERANCE


def resolve_model_dir(path: str | os.PathLike) -> Path:
    """``path`` when it holds ``hstu_config.json``, else ``path/hstu_compute/1``."""
    folder = Path(path)
    if (folder / CONFIG_FILENAME).exists():
        return folder
    candidate = folder / MODEL_SUBDIR
    if not (candidate / CONFIG_FILENAME).exists():
        raise FileNotFoundError(f"{path}: no {CONFIG_FILENAME} there or in {candidate}")
    return candidate
