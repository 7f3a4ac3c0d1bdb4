"""The one reader of tritonserver's Prometheus metrics, for the tools (bench, demo, scale-out) and the tests.

- `scrape(url) -> Metrics`: GET a `/metrics` endpoint and parse it.
- `parse(text) -> Metrics`: the samples of a Prometheus text exposition (version 0.0.4); comment
  lines (`# HELP`, `# TYPE`) are skipped, a line that is neither raises ValueError naming it.
- `Metrics.value(name, **labels) -> float`: the sum of the series `name` whose labels include
  `labels`; `MissingSeries` when there is none, so a renamed or absent series never reads as 0.
- `Metrics.samples(name, **labels) -> list[Sample]`: those series one by one (possibly none).
- `Metrics.label_values(name, label, **labels) -> list[str]`: the values `label` takes on them.
- `Metrics.names(prefix) -> list[str]`: the series names that start with `prefix`.

A `Metrics` is one snapshot; subtract two snapshots' values for what happened in between.
"""
from __future__ import annotations

import re
import urllib.request
from typing import NamedTuple


class Sample(NamedTuple):
    """One series' value in one scrape: `name{labels} value`."""

    name: str
    labels: dict[str, str]
    value: float


class MissingSeries(LookupError):
    """A series asked for by name and labels is not on the metrics endpoint."""


class Metrics:
    """One scrape of a metrics endpoint: every sample, queried by name and labels."""

    def __init__(self, samples: list[Sample], source: str = "metrics text"):
        self.source = source  # the URL it came from, for error messages
        self._by_name: dict[str, list[Sample]] = {}
        for sample in samples:
            self._by_name.setdefault(sample.name, []).append(sample)

    def samples(self, name: str, **labels: str) -> list[Sample]:
        return [s for s in self._by_name.get(name, []) if all(s.labels.get(k) == v for k, v in labels.items())]

    def value(self, name: str, **labels: str) -> float:
        found = self.samples(name, **labels)
        if not found:
            raise MissingSeries(f"no series {_describe(name, labels)} on {self.source} "
                                f"({len(self._by_name.get(name, []))} series named {name} with other labels)")
        return sum(s.value for s in found)

    def label_values(self, name: str, label: str, **labels: str) -> list[str]:
        return sorted({s.labels[label] for s in self.samples(name, **labels) if label in s.labels})

    def names(self, prefix: str = "") -> list[str]:
        return sorted(name for name in self._by_name if name.startswith(prefix))


def scrape(url: str, timeout_s: float = 10.0) -> Metrics:
    with urllib.request.urlopen(url, timeout=timeout_s) as r:
        return parse(r.read().decode(), source=url)


def parse(text: str, source: str = "metrics text") -> Metrics:
    samples = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if m is None:
            raise ValueError(f"{source} line {number}: not a Prometheus sample: {line!r}")
        labels = {k: _unescape(v) for k, v in _LABEL.findall(m.group("labels") or "")}
        samples.append(Sample(m.group("name"), labels, float(m.group("value"))))
    return Metrics(samples, source)


# ---- helpers ------------------------------------------------------------------------------------

# name{label="value",...} value [timestamp]; label values escape \\, \" and \n.
_SAMPLE = re.compile(r'^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>(?:[^"}]|"(?:[^"\\]|\\.)*")*)\})?'
                     r'\s+(?P<value>\S+)(?:\s+-?\d+)?$')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')
_ESCAPES = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}


def _unescape(value: str) -> str:
    return re.sub(r'\\[\\"n]', lambda m: _ESCAPES[m.group(0)], value)


def _describe(name: str, labels: dict[str, str]) -> str:
    return name + ("{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else "")
