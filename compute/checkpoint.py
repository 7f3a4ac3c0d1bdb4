"""Model weights on disk and the fingerprint that names their KV cache.

Files in a model folder (``model_repository/hstu_compute/1``):
- ``hstu_config.json``: ``HSTUConfig`` (committed);
- ``checkpoint.pt``: the ``state_dict`` of ``HSTUModel`` (``torch.save``; loaded with
  ``weights_only=True``).

Operations:
- ``init_model(config)``: a model with the seeded random initialisation (``config.seed``); the
  global torch RNG is left as it was.
- ``save_checkpoint(model, model_dir)``: writes the config and the weights, atomically.
- ``ensure_checkpoint(model_dir)``: writes the seeded initialisation when no checkpoint exists
  (deterministic, so two processes racing to do it write the same bytes).
- ``load_model(model_dir, device)``: config + weights -> ``HSTUModel`` in eval mode, in the
  config's dtype.
- ``fingerprint(model_dir)``: sha256 hex over the config's canonical JSON, the model's source
  (``compute/model.py``) and every weight's name, dtype, shape and bytes, in name order. It is
  the KV namespace (invariant 2 of docs/ARCHITECTURE.md): new weights, config or maths never read old pages.

``load_model`` and ``fingerprint`` call ``ensure_checkpoint`` first (ARCHITECTURE.md: the seeded
initialisation stands in when no checkpoint is given), so every process sees the same weights.
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

import torch

from compute.config import HSTUConfig
from compute.files import replace_atomically
from compute.model import HSTUModel

logger = logging.getLogger(__name__)

__all__ = ["CHECKPOINT_FILENAME", "ensure_checkpoint", "fingerprint", "init_model", "load_model",
           "save_checkpoint"]

CHECKPOINT_FILENAME = "checkpoint.pt"


def init_model(config: HSTUConfig) -> HSTUModel:
    """``HSTUModel`` with weights drawn from a generator seeded by ``config.seed`` (fp32, CPU)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        model = HSTUModel(config)
    return model.eval()


def save_checkpoint(model: HSTUModel, model_dir: str | os.PathLike) -> Path:
    """Writes ``hstu_config.json`` and ``checkpoint.pt`` into ``model_dir``; returns the checkpoint path."""
    folder = Path(model_dir)
    folder.mkdir(parents=True, exist_ok=True)
    model.config.save(folder)
    target = folder / CHECKPOINT_FILENAME
    state = {name: tensor.detach().cpu() for name, tensor in model.state_dict().items()}
    replace_atomically(target, lambda tmp: torch.save(state, tmp))
    logger.info("saved checkpoint %s", target)
    return target


def ensure_checkpoint(model_dir: str | os.PathLike) -> Path:
    """The checkpoint path, after writing the seeded initialisation if there was none."""
    folder = Path(model_dir)
    target = folder / CHECKPOINT_FILENAME
    if not target.exists():
        config = HSTUConfig.load(folder)
        logger.info("no checkpoint in %s: writing the seeded random initialisation (seed %d)",
                    folder, config.seed)
        save_checkpoint(init_model(config), folder)
    return target


def load_model(model_dir: str | os.PathLike, device: str | torch.device = "cpu") -> HSTUModel:
    """``HSTUModel`` with the folder's config and weights, eval mode, on ``device``, in the
    config's dtype."""
    folder = Path(model_dir)
    config = HSTUConfig.load(folder)
    model = HSTUModel(config)
    model.load_state_dict(_load_state(folder))
    return model.to(device=device, dtype=config.torch_dtype).eval()


def fingerprint(model_dir: str | os.PathLike) -> str:
    """sha256 hex digest of the folder's config JSON and weights (see the module docstring), and
    of the model's source: KV computed by other maths must not be read back (invariant 2)."""
    from compute import model as model_module  # late: model imports this module's neighbours

    folder = Path(model_dir)
    config = HSTUConfig.load(folder)
    digest = hashlib.sha256()
    digest.update(b"hstu-compute.fingerprint.v2\0")
    digest.update(config.to_json().encode("utf-8"))
    digest.update(Path(model_module.__file__).read_bytes())
    state = _load_state(folder)
    for name in sorted(state):
        tensor = state[name].detach().cpu().contiguous()
        digest.update(f"\0{name}\0{tensor.dtype}\0{tuple(tensor.shape)}\0".encode("utf-8"))
        digest.update(tensor.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


# ---------------------------------------------------------------------------------------
# helpers


def _load_state(folder: Path) -> dict[str, torch.Tensor]:
    path = ensure_checkpoint(folder)
    return torch.load(path, map_location="cpu", weights_only=True)
