"""deploy.runtime.sealed_scores: the checksum row hstu_compute appends to the scores it hands
kv_offload, which catches a score changed in transit (a 4-byte word overwritten, as
tritonserver 2.51's Python backend does to a batched input now and then). No server."""
from __future__ import annotations

import pytest
import torch

from deploy.runtime.sealed_scores import seal, unseal


@pytest.mark.parametrize("num_tasks", [1, 3])
def test_sealed_scores_come_back_unchanged(num_tasks: int) -> None:
    scores = torch.randn(64, num_tasks)
    sealed = seal(scores)
    assert sealed.shape == (65, num_tasks)
    assert torch.equal(unseal(sealed), scores)


@pytest.mark.parametrize("word", [1, -1, 0x3F800000])  # the writes seen; 1.0's bits
def test_any_overwritten_word_is_caught(word: int) -> None:
    scores = torch.randn(64, 3)
    for row, task in ((0, 0), (20, 1), (63, 2), (64, 0), (64, 1)):  # a score, or the checksum row itself
        sealed = seal(scores)
        if sealed.view(torch.int32)[row, task].item() == word:
            continue
        sealed.view(torch.int32)[row, task] = word
        assert unseal(sealed) is None, (row, task, word)
