"""HSTUConfig and the token contract: defaults, JSON round trip, and errors that name the field."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from compute import HSTUConfig, check_request, history_tokens

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_committed_config_is_the_default():
    assert HSTUConfig.load(REPO_ROOT / "model_repository" / "hstu_compute" / "1") == HSTUConfig()


def test_json_round_trip(tmp_path):
    config = HSTUConfig(num_layers=3, page_size=16, seed=7)
    config.save(tmp_path)
    assert HSTUConfig.load(tmp_path) == config
    assert HSTUConfig.load(tmp_path / "hstu_config.json") == config


@pytest.mark.parametrize("field, value", [
    ("page_size", 31), ("page_size", 0), ("num_layers", 0), ("item_vocab", 1),
    ("dtype", "float64"), ("num_heads", 2.0), ("max_candidates", True),
])
def test_invalid_config_names_the_field(field, value):
    with pytest.raises(ValueError, match=f"HSTUConfig.{field}"):
        HSTUConfig(**{field: value})


def test_unknown_key_is_refused(tmp_path):
    data = dataclasses.asdict(HSTUConfig())
    data["num_layer"] = 3
    (tmp_path / "hstu_config.json").write_text(__import__("json").dumps(data))
    with pytest.raises(ValueError, match="num_layer"):
        HSTUConfig.load(tmp_path)


def test_history_tokens_interleave_items_and_actions():
    config = HSTUConfig()
    tokens = history_tokens(np.array([5, 7, 99_999]), np.array([0, 3, 15]), config)
    assert tokens.dtype == torch.int64
    assert tokens.tolist() == [5, 100_000, 7, 100_003, 99_999, 100_015]
    assert history_tokens([], [], config).tolist() == []


C = HSTUConfig()
I64 = np.int64


@pytest.mark.parametrize("items, actions, cands, field", [
    ([1, 2], [0], [1], "action_ids"),  # length mismatch
    ([0, 2], [0, 0], [1], "item_ids"),  # 0 is padding
    ([100_000], [0], [1], "item_ids"),
    ([1], [16], [1], "action_ids"),
    ([1], [-1], [1], "action_ids"),
    ([1], [0], [], "candidate_ids"),  # empty
    ([1], [0], [1] * 257, "candidate_ids"),  # too many
    ([1], [0], [100_000], "candidate_ids"),
    ([1] * 2049, [0] * 2049, [1], "item_ids"),  # history too long
    (np.array([1], np.int32), [0], [1], "item_ids"),  # wrong dtype
    ([1], [0], np.array([[1]], I64), "candidate_ids"),  # not 1-D
])
def test_bad_requests_name_the_field(items, actions, cands, field):
    items = np.asarray(items, dtype=I64) if isinstance(items, list) else items
    message = check_request(items, np.asarray(actions, dtype=I64), np.asarray(cands, dtype=I64)
                            if isinstance(cands, list) else cands, C)
    assert message is not None and message.startswith(field), message


def test_good_request_passes():
    assert check_request(np.arange(1, 2049, dtype=I64), np.zeros(2048, I64), np.ones(256, I64), C) is None
    assert check_request([], [], [1], C) is None


def test_an_id_with_its_upper_word_set_looks_corrupted_in_transit_and_other_bad_ids_do_not() -> None:
    """tritonserver 2.51's Python backend sets the upper 32-bit word of a batched input's id to 1
    or all ones now and then; such a request is answered retryable (docs/ARCHITECTURE.md)."""
    from compute.tokens import looks_corrupted_in_transit

    config = HSTUConfig()
    items, actions, cands = torch.arange(1, 50), torch.zeros(49, dtype=torch.int64), torch.arange(1, 5)
    corrupted = items.clone()
    corrupted[34] += 2**32
    assert looks_corrupted_in_transit(corrupted, actions, cands, config)
    minus = actions.clone()
    minus[6] -= 2**32  # 0 with its upper word all ones
    assert looks_corrupted_in_transit(items, minus, cands, config)
    for bad in (config.item_vocab, -1, 2**40 + 5, 2**32 + config.item_vocab):  # a client's mistakes
        wrong = items.clone()
        wrong[3] = bad
        assert not looks_corrupted_in_transit(wrong, actions, cands, config), bad
    assert not looks_corrupted_in_transit(items, actions, cands, config)  # nothing bad at all
