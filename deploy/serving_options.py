"""The command-line options of `ServingSettings`, declared once for every tool that starts a server
(hstu-serve, hstu-cluster, the demo, hstu-bench).

- `add_serving_options(parser, names, **defaults)`: `--model-config`, and one option per named
  `ServingSettings` field (`pool_pages` -> `--pool-pages`), typed and defaulted from the field;
  `defaults` replaces a field's default for this tool (hstu-serve: `store="embedded"`).
- `serving_settings(args, names, **fixed) -> ServingSettings`: the settings those options parsed
  to, plus the fields the tool decides itself (`fixed`: run_dir, store_endpoint, ...).
- `model_dir_for(model_config) -> Path`: where a custom HSTUConfig JSON is built and served from.

The fields that say where things are (run_dir, model_dir, store_endpoint) are not options here:
each tool names them in its own words (`--run-dir`, `--model-config`, `--mooncake-master`).
"""
from __future__ import annotations

import argparse
import hashlib
import shutil
from dataclasses import MISSING, fields
from pathlib import Path

from deploy.runtime.settings import (DEFAULT_MODEL_DIR, DEVICES, HOST_HIT_COPIERS, REPO_ROOT,
                                     STORE_KINDS, ServingSettings)

# ServingSettings field -> its option's help. Choices come from the settings module's own lists.
HELP: dict[str, str] = {
    "device": "where hstu_compute runs",
    "store": ("host KV tier: embedded (our store process, started here), mooncake (our store process in "
              "front of a running Mooncake master), flexkv (FlexKV in its own store process, started here; "
              "CUDA only, see below), none (the device cache alone)"),
    "pool_pages": "device page pool size, in pages (per server)",
    "lease_ttl_s": "seconds before a lease not committed returns its pages",
    "store_timeout_s": "seconds a host store call on the request path waits before failing open",
    "min_host_pages": ("the fewest pages past the device prefix worth onboarding from the host store; a "
                       "request with fewer recomputes them; 0: by device, cuda 12, cpu 2, as measured for the "
                       "shipped configs (README: when a host hit pays)"),
    "host_hit_copy": ("who copies a host hit's pages into the ensemble's pool: reader (hstu_compute, from the "
                      "embedded store's DRAM tier in shared memory) or store (the store process; always so for "
                      "flexkv and mooncake)"),
    "cuda_graphs": ("--device cuda: the most CUDA graphs of the compiled forward hstu_compute keeps, one per "
                    "bucketed batch shape (0: none, every batch calls the package)"),
    "mooncake_segment_bytes": ("--store mooncake: host memory the store process gives the tier "
                               "(0: memory nodes hold it)"),
    "mooncake_local_hostname": "--store mooncake: the address Mooncake peers reach this host on",
}
CHOICES: dict[str, tuple[str, ...]] = {"device": DEVICES, "store": STORE_KINDS, "host_hit_copy": HOST_HIT_COPIERS}


def add_serving_options(parser: argparse.ArgumentParser, names: tuple[str, ...], **defaults: object) -> None:
    parser.add_argument("--model-config", type=Path, help="HSTUConfig JSON (default: the model dir's)")
    declared = {f.name: f for f in fields(ServingSettings)}
    for name in names:
        if name not in HELP:
            raise ValueError(f"add_serving_options: {name!r} is not a ServingSettings option; options: {sorted(HELP)}")
        default = defaults.get(name, declared[name].default)
        assert default is not MISSING, f"ServingSettings.{name} has no plain default to type its option by"
        parser.add_argument("--" + name.replace("_", "-"), type=type(default), default=default,
                            choices=CHOICES.get(name), help=f"{HELP[name]} (default: {default})")
    unknown = set(defaults) - set(names)
    if unknown:
        raise ValueError(f"add_serving_options: defaults for options not added: {sorted(unknown)}")


def serving_settings(args: argparse.Namespace, names: tuple[str, ...], **fixed: object) -> ServingSettings:
    """ServingSettings from parsed options; ValueError (naming the variable and the fix) on a bad one."""
    model_dir = DEFAULT_MODEL_DIR if args.model_config is None else model_dir_for(args.model_config)
    return ServingSettings(model_dir=model_dir, **{name: getattr(args, name) for name in names}, **fixed)


def model_dir_for(model_config: Path) -> Path:
    """A per-config model dir under .cache/models holding a copy of `model_config`, so that serving a
    custom config never edits the repository's model dir; the AOTI package is built next to it."""
    text = Path(model_config).read_bytes()
    model_dir = REPO_ROOT / ".cache" / "models" / hashlib.sha256(text).hexdigest()[:16]
    model_dir.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(model_config, model_dir / "hstu_config.json")
    return model_dir
