"""deploy.metrics, the one Prometheus reader: what tritonserver's /metrics text parses into, and
that a missing series fails loudly instead of reading as 0."""
from __future__ import annotations

import pytest

from deploy.metrics import MissingSeries, Sample, parse

TEXT = """\
# HELP hstu_kv_lookups_total KV lookups by outcome
# TYPE hstu_kv_lookups_total counter
hstu_kv_lookups_total{model="kv_lookup_alloc",outcome="miss"} 3
hstu_kv_lookups_total{model="kv_lookup_alloc",outcome="device_hit"} 5
hstu_kv_lookups_total{model="hstu_monolithic",outcome="miss"} 7
hstu_kv_pages{model="kv_lookup_alloc",state="free"} 4090
nv_inference_count{model="hstu_ranking",version="1"} 1.5e+03
odd{path="a \\"quoted\\" \\\\ value, {braced}"} 1 1700000000000
up 1
"""


def test_samples_keep_name_labels_and_value() -> None:
    metrics = parse(TEXT)

    assert metrics.samples("hstu_kv_pages") == [Sample("hstu_kv_pages", {"model": "kv_lookup_alloc", "state": "free"},
                                                       4090.0)]
    assert metrics.value("nv_inference_count", model="hstu_ranking") == 1500.0
    assert metrics.samples("odd")[0].labels == {"path": 'a "quoted" \\ value, {braced}'}
    assert metrics.value("up") == 1.0


@pytest.mark.parametrize("labels, expected", [
    ({}, 15.0),
    ({"model": "kv_lookup_alloc"}, 8.0),
    ({"model": "kv_lookup_alloc", "outcome": "miss"}, 3.0),
    ({"outcome": "miss"}, 10.0),
])
def test_value_sums_the_series_whose_labels_include_the_query(labels: dict[str, str], expected: float) -> None:
    assert parse(TEXT).value("hstu_kv_lookups_total", **labels) == expected


def test_label_values_lists_what_a_label_takes() -> None:
    metrics = parse(TEXT)

    assert metrics.label_values("hstu_kv_lookups_total", "model") == ["hstu_monolithic", "kv_lookup_alloc"]
    assert metrics.label_values("hstu_kv_lookups_total", "outcome", model="hstu_monolithic") == ["miss"]


@pytest.mark.parametrize("name, labels", [
    ("hstu_kv_renamed_total", {}),
    ("hstu_kv_lookups_total", {"outcome": "host_hit"}),
    ("hstu_kv_lookups_total", {"model": "kv_offload"}),
])
def test_a_missing_series_raises_naming_it(name: str, labels: dict[str, str]) -> None:
    with pytest.raises(MissingSeries, match=name):
        parse(TEXT, source="http://127.0.0.1:8002/metrics").value(name, **labels)


def test_a_line_that_is_not_a_sample_raises_naming_its_number() -> None:
    with pytest.raises(ValueError, match="line 2"):
        parse("up 1\nthis is not { a sample\n")
