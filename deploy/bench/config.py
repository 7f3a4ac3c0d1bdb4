"""What hstu-bench measures and with what load: the phases, the two models compared, `BenchConfig`,
and `ServedModel` (the served model's config and page size)."""
from __future__ import annotations

from dataclasses import dataclass

from compute import HSTUConfig
from deploy.runtime.cache_owner import pool_spec
from deploy.runtime.schema import ENSEMBLE, MONOLITHIC
from deploy.runtime.settings import ServingSettings

MODELS = (ENSEMBLE, MONOLITHIC)
PHASES = ("sweep", "perf_analyzer", "cache", "hop_overhead", "device_hit", "offload", "host_hits")


@dataclass
class BenchConfig:
    concurrencies: tuple[int, ...] = (1, 2, 4, 8, 16)
    repeats: int = 3
    users: int = 20
    requests: int = 200
    initial_events_median: float = 200.0
    warmup_requests: int = 32
    phases: tuple[str, ...] = PHASES
    pa_interval_ms: int = 3000  # perf_analyzer: 3 windows of this length per point
    overhead_requests: int = 30
    device_hit_requests: int = 100  # per block of the device_hit phase
    device_hit_tokens: tuple[int, ...] = (1024, 4096)  # its history lengths
    cache_tokens: tuple[int, ...] = (256, 1024, 4096)  # the cache phase's history lengths
    offload_concurrency: int = 8  # also the host_hits phase's
    seed: int = 0

    def __post_init__(self) -> None:
        if self.repeats < 1:
            raise ValueError(f"repeats={self.repeats}: expected >= 1")
        if not self.cache_tokens or min(self.cache_tokens) < 2:
            raise ValueError(f"cache_tokens={self.cache_tokens}: expected history lengths of >= 2 tokens")
        if not self.concurrencies or min(self.concurrencies) < 1:
            raise ValueError(f"concurrencies={self.concurrencies}: expected positive integers")
        unknown = set(self.phases) - set(PHASES)
        if unknown:
            raise ValueError(f"phases: unknown {sorted(unknown)}; expected some of {PHASES}")

    @classmethod
    def quick(cls) -> "BenchConfig":
        return cls(users=16, requests=128, initial_events_median=150.0, warmup_requests=24, pa_interval_ms=2000,
                   overhead_requests=20, device_hit_requests=30, device_hit_tokens=(1024,))


@dataclass
class ServedModel:
    """The served HSTUConfig, and the bytes of one page of its KV cache."""

    config: HSTUConfig
    page_bytes: int

    @classmethod
    def load(cls, settings: ServingSettings) -> "ServedModel":
        config = HSTUConfig.load(settings.model_dir)
        return cls(config, pool_spec(config, settings).page_bytes)

