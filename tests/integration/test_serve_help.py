"""What `hstu-serve --help` promises: the nginx front beyond loopback, and `--store flexkv`
labeled unverified (choosing it warns). No server is started."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from kvlifecycle.store import STORE_KINDS
from tests.conftest import REPO_ROOT

HSTU_SERVE = str(Path(sys.executable).parent / "hstu-serve")


def test_help_lists_every_store_and_labels_flexkv_unverified() -> None:
    out = subprocess.run([HSTU_SERVE, "--help"], cwd=REPO_ROOT, capture_output=True, text=True, check=True).stdout
    assert "--store {" + ",".join(STORE_KINDS) + "}" in out
    assert "flexkv (UNVERIFIED, experimental" in out and "--store flexkv is UNVERIFIED" in out
    assert "beyond loopback" in out and "nginx" in out and "413" in out


def test_choosing_flexkv_logs_a_warning(tmp_path: Path) -> None:
    done = subprocess.run([HSTU_SERVE, "--store", "flexkv", "--print-env", "--run-dir", str(tmp_path / "run")],
                          cwd=REPO_ROOT, capture_output=True, text=True, check=True)
    assert "WARNING --store flexkv is UNVERIFIED (experimental)" in done.stderr, done.stderr
    assert "export HSTU_STORE=flexkv" in done.stdout
