"""What `hstu-serve --help` promises: the nginx front beyond loopback, how to build FlexKV for
`--store flexkv` (CUDA only, else a usage error), and the serving settings' options shared with
hstu-cluster. No server is started."""
from __future__ import annotations

import subprocess
import sys
from dataclasses import fields
from pathlib import Path

from deploy import cluster as hstu_cluster
from deploy import serve_cli
from deploy.runtime.settings import ServingSettings
from kvlifecycle.store import STORE_KINDS
from tests.conftest import REPO_ROOT

HSTU_SERVE = str(Path(sys.executable).parent / "hstu-serve")


def test_help_lists_every_store_and_how_to_build_flexkv() -> None:
    out = subprocess.run([HSTU_SERVE, "--help"], cwd=REPO_ROOT, capture_output=True, text=True, check=True).stdout
    assert "--store {" + ",".join(STORE_KINDS) + "}" in out
    assert "deploy/build_flexkv.sh" in out and ". .flexkv/env.sh" in out
    assert "beyond loopback" in out and "nginx" in out and "413" in out


def test_flexkv_on_the_cpu_is_a_usage_error_naming_the_fix(tmp_path: Path) -> None:
    done = subprocess.run([HSTU_SERVE, "--store", "flexkv", "--device", "cpu", "--print-env",
                           "--run-dir", str(tmp_path / "run")], cwd=REPO_ROOT, capture_output=True, text=True)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "HSTU_STORE=flexkv with HSTU_DEVICE=cpu" in done.stderr and "--device cuda" in done.stderr


def test_flexkv_recipe_starts_the_flexkv_store_process(tmp_path: Path) -> None:
    done = subprocess.run([HSTU_SERVE, "--store", "flexkv", "--device", "cuda", "--print-env",
                           "--run-dir", str(tmp_path / "run")], cwd=REPO_ROOT, capture_output=True, text=True,
                          check=True)
    assert "export HSTU_STORE=flexkv" in done.stdout
    assert "-m kvlifecycle.store.flexkv --endpoint ipc://" in done.stdout, done.stdout


def test_serve_and_cluster_options_are_the_serving_settings(tmp_path: Path) -> None:
    shared = ["--device", "cpu", "--pool-pages", "96", "--lease-ttl-s", "5", "--store-timeout-s", "2"]

    serve, _ = serve_cli.parse_args([*shared, "--run-dir", str(tmp_path / "run"), "--store", "none"])
    cluster = hstu_cluster.parse_args(shared)

    expected = {"device": "cpu", "pool_pages": 96, "lease_ttl_s": 5.0, "store_timeout_s": 2.0}
    for settings in (serve.serving, cluster.server.serving):
        assert {name: getattr(settings, name) for name in expected} == expected
    assert (serve.serving.run_dir, serve.serving.store) == (tmp_path / "run", "none")
    assert set(serve_cli.SERVE_OPTIONS) | set(hstu_cluster.CLUSTER_OPTIONS) <= {f.name for f in fields(ServingSettings)}


def test_a_bad_setting_is_a_usage_error_naming_it(tmp_path: Path) -> None:
    done = subprocess.run([HSTU_SERVE, "--pool-pages", "1", "--print-env", "--run-dir", str(tmp_path / "run")],
                          cwd=REPO_ROOT, capture_output=True, text=True)

    assert done.returncode == 2, done.stdout + done.stderr
    assert "HSTU_POOL_PAGES=1: need at least 2 pages" in done.stderr, done.stderr
