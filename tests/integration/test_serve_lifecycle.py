"""hstu-serve as a user runs it: starts, serves, and leaves nothing behind on Ctrl-C."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from deploy.client import RankingClient
from deploy.trace import TraceConfig, generate
from tests.conftest import REPO_ROOT, free_ports
from tests.helpers import assert_scores_match, wait_for

pytestmark = pytest.mark.integration


def test_ctrl_c_leaves_no_process_behind(tmp_path: Path, reference) -> None:
    http, grpc, metrics = free_ports(3)
    cmd = [str(Path(sys.executable).parent / "hstu-serve"), "--http-port", str(http), "--grpc-port", str(grpc),
           "--metrics-port", str(metrics), "--run-dir", str(tmp_path / "run")]
    launcher = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        endpoints = None
        deadline = time.monotonic() + 600
        while endpoints is None and time.monotonic() < deadline:
            line = launcher.stdout.readline()
            assert line, f"hstu-serve exited early with {launcher.wait()}"
            if line.startswith("{"):
                endpoints = json.loads(line)
        assert endpoints and endpoints["grpc"] == f"127.0.0.1:{grpc}"

        # Arrange: the launcher's whole process tree while serving.
        tree = psutil.Process(launcher.pid).children(recursive=True)
        names = " ".join(p.name() for p in tree)
        assert "tritonserver" in names and "triton_python_backend_stub" in names, names
        assert any("kvlifecycle.store" in " ".join(p.cmdline()) for p in tree), "no host store process"

        # Arrange: a client keeps its gRPC stream open, idle, after one answer. Such a stream keeps
        # the ensemble live in tritonserver until its 60 s exit timeout, which once held every stop.
        request = generate(TraceConfig(num_users=1, num_requests=1, initial_events_median=20))[0]
        client = RankingClient(endpoints["grpc"])
        assert_scores_match(client.score(request), reference.score(request.user_id, request.item_ids,
                                                                    request.action_ids, request.candidate_ids),
                            1e-4, "served by hstu-serve")

        # Act: Ctrl-C.
        launcher.send_signal(signal.SIGINT)
        assert launcher.wait(timeout=120) == 0
        client.close()
        out = launcher.stdout.read()
        assert "did not stop within" not in out, out[-3000:]  # the stop waited for no timeout
        triton_log = (tmp_path / "run" / "tritonserver.log").read_text()
        assert "successfully unloaded 'kv_offload'" in triton_log  # its finalize (the offload flush) ran

        # Check: every process of the tree is gone.
        def alive() -> list[psutil.Process]:
            left = []
            for p in tree:
                try:
                    if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                        left.append(p)
                except psutil.NoSuchProcess:
                    pass
            return left

        wait_for(lambda: not alive(), 10, lambda: f"every process to exit; left: {[(p.pid, p.name()) for p in alive()]}")
    finally:
        if launcher.poll() is None:
            launcher.kill()


def test_print_env_describes_a_manual_start(tmp_path: Path) -> None:
    out = subprocess.run([str(Path(sys.executable).parent / "hstu-serve"), "--print-env", "--run-dir",
                          str(tmp_path)], cwd=REPO_ROOT, capture_output=True, text=True, check=True).stdout
    assert "export LD_LIBRARY_PATH=" in out and "nvidia_pytriton.libs" in out
    assert "export HSTU_STORE_ENDPOINT=" in out
    assert "tritonserver --model-repository=" in out


def test_perf_analyzer_runs_from_the_venv() -> None:
    out = subprocess.run([str(Path(sys.executable).parent / "perf_analyzer"), "--version"], capture_output=True,
                         text=True, check=True)
    assert "Perf Analyzer Version 2.51" in out.stdout + out.stderr  # it prints the version on stderr
