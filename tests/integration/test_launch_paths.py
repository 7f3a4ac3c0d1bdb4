"""The two hand-started launch paths, each exactly as the README and `hstu-serve --print-env` show it.

1. Plain `tritonserver --model-repository model_repository` with only PATH and LD_LIBRARY_PATH
   (as `--print-env` prints them) and HOME: no HSTU_* variable. The models must agree on a
   private run directory by themselves and serve from the device cache alone.
2. The printed recipe, run as printed by `bash -c`: it starts the host store and tritonserver;
   a device pool of 16 pages forces a user's pages out to the store, so the user's next request
   is a host hit.

Each test starts its processes in a new session and kills the whole process group at the end,
then checks that no process of the tree it saw is left.
"""
from __future__ import annotations

import os
import shlex
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest

from deploy.launcher import build_model, wait_until_ready
from deploy.metrics import scrape
from deploy.replay import replay
from deploy.runtime.schema import ENSEMBLE, MONOLITHIC, RankingRequest
from deploy.runtime.settings import DEFAULT_MODEL_DIR, default_run_dir
from deploy.score_check import check_scores
from deploy.trace import TraceConfig, generate
from deploy.triton_env import find_triton
from kvlifecycle.control import ControlClient
from tests.conftest import REPO_ROOT, free_ports

pytestmark = pytest.mark.integration

HSTU_SERVE = Path(sys.executable).parent / "hstu-serve"
TOLERANCE = 1e-4
LOOKUP = "kv_lookup_alloc"


def print_env(*args: str) -> str:
    return subprocess.run([str(HSTU_SERVE), "--print-env", *args], cwd=REPO_ROOT, capture_output=True, text=True,
                          check=True).stdout


def exported(recipe: str) -> dict[str, str]:
    """The `export NAME=VALUE` lines of a printed recipe."""
    out = {}
    for line in recipe.splitlines():
        if line.startswith("export "):
            name, _, value = shlex.split(line)[1].partition("=")
            out[name] = value
    return out


def wait_ready(proc: subprocess.Popen, http_port: int, log: Path, timeout_s: float = 600.0) -> None:
    def check_alive() -> None:
        assert proc.poll() is None, f"exited with {proc.returncode} before {ENSEMBLE} was ready:\n{tail(log)}"

    url = f"http://127.0.0.1:{http_port}/v2/models/{ENSEMBLE}/ready"
    if not wait_until_ready(url, timeout_s, check_alive):
        raise AssertionError(f"{ENSEMBLE} not ready after {timeout_s:.0f}s:\n{tail(log)}")


def stop_group(proc: subprocess.Popen, tree: list[psutil.Process]) -> list[str]:
    """SIGTERM the process group, wait, SIGKILL what is left; returns the processes of `tree`
    still alive after all that (each one is a leak)."""
    for sig, wait_s in ((signal.SIGTERM, 90.0), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            pass
        gone_by = time.monotonic() + wait_s
        while time.monotonic() < gone_by and any(_alive(p) for p in tree):
            time.sleep(0.2)
    return [f"{p.pid} {p.name()}" for p in tree if _alive(p)]


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def tail(path: Path, lines: int = 60) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else "(no log)"


def kv_metric(metrics_port: int, name: str, **labels: str) -> float:
    return scrape(f"http://127.0.0.1:{metrics_port}/metrics", timeout_s=5).value(name, **labels)


def served_ok(trace: list[RankingRequest], grpc_port: int, model: str = ENSEMBLE, concurrency: int = 1) -> None:
    """Replay `trace`; every request must be answered and match the reference scorer."""
    result = replay(trace, f"127.0.0.1:{grpc_port}", model=model, concurrency=concurrency, timeout_s=120.0)
    worst = check_scores(trace, result, REPO_ROOT / "model_repository")  # raises on errors or nothing scored
    assert worst <= TOLERANCE, f"{model}: max abs diff {worst:.2e} vs the reference scorer"


def test_plain_tritonserver_serves_with_no_hstu_variable(tmp_path: Path) -> None:
    build_model(DEFAULT_MODEL_DIR, "cpu")  # the AOTI package; tritonserver alone does not build it
    recipe = print_env("--run-dir", str(tmp_path / "unused"))
    env = {k: v for k, v in exported(recipe).items() if k in ("PATH", "LD_LIBRARY_PATH")}
    env["HOME"] = os.environ.get("HOME", str(tmp_path))
    http, grpc, metrics = free_ports(3)
    # The README's launch, on free loopback ports instead of 8000-8002 on every interface.
    cmd = ["tritonserver", "--model-repository", "model_repository", "--backend-directory",
           str(find_triton().backend_dir),
           "--http-address", "127.0.0.1", "--grpc-address", "127.0.0.1", "--metrics-address", "127.0.0.1",
           "--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics)]
    log = tmp_path / "tritonserver.log"
    with open(log, "wb") as out:
        triton = subprocess.Popen(cmd, env=env, cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT,
                                  start_new_session=True)
    tree: list[psutil.Process] = []
    try:
        wait_ready(triton, http, log)
        tree = [psutil.Process(triton.pid), *psutil.Process(triton.pid).children(recursive=True)]

        trace = generate(TraceConfig(num_users=4, num_requests=16, initial_events_median=60.0, seed=17))
        for model in (ENSEMBLE, MONOLITHIC):
            served_ok(trace, grpc, model=model, concurrency=2)

        # The models met in the per-user default run directory, created private.
        run_dir = default_run_dir({})
        st = os.lstat(run_dir)
        assert stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid(), f"{run_dir}: {st}"
        assert stat.S_IMODE(st.st_mode) == 0o700, f"{run_dir}: mode {stat.S_IMODE(st.st_mode):o}"
        assert (run_dir / "control.sock").exists() and (run_dir / "pool.json").exists()
        warnings = tail(log, 10_000).count("serving from the device cache alone")
        assert warnings == 1, f"the no-store warning was logged {warnings} times:\n{tail(log)}"
    finally:
        left = stop_group(triton, tree)
    assert not left, f"left behind: {left}"


def request(user: int, events: int, seed: int = 0) -> RankingRequest:
    rng = np.random.default_rng([user, seed])
    return RankingRequest(user, rng.integers(1, 100_000, events).tolist(), rng.integers(0, 16, events).tolist(),
                          rng.integers(1, 100_000, 8).tolist())


def grown(r: RankingRequest, events: int) -> RankingRequest:
    """The same user's next request: its history plus `events` new events."""
    more = request(r.user_id, events, seed=1)
    return RankingRequest(r.user_id, r.item_ids + more.item_ids, r.action_ids + more.action_ids, r.candidate_ids)


def wait_drained(control_endpoint: str, timeout_s: float = 60.0) -> None:
    """Until no page is leased or pinned: every commit done and every offload reaped."""
    deadline = time.monotonic() + timeout_s
    with ControlClient(control_endpoint, timeout_s=30.0) as control:
        while True:
            stats = control.stats()
            if stats["pages_leased"] == 0 and stats["pages_pinned"] == 0:
                return
            assert time.monotonic() < deadline, f"offloads not drained after {timeout_s:.0f}s: {stats}"
            time.sleep(0.1)


def test_printed_recipe_runs_as_printed_and_gets_host_hits(tmp_path: Path) -> None:
    build_model(DEFAULT_MODEL_DIR, "cpu")
    http, grpc, metrics = free_ports(3)
    run_dir = tmp_path / "run"
    # 16 pages of 32 tokens: two users of 400-480 tokens do not fit together.
    recipe = print_env("--run-dir", str(run_dir), "--http-port", str(http), "--grpc-port", str(grpc),
                       "--metrics-port", str(metrics), "--pool-pages", "16", "--store-dram-bytes", str(256 << 20))
    (tmp_path / "recipe.sh").write_text(recipe)  # for a post-mortem
    log = tmp_path / "recipe.log"
    with open(log, "wb") as out:
        # Run from elsewhere, with a bare environment: the recipe must carry everything it needs.
        shell = subprocess.Popen(["bash", "-c", recipe], env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
                                 cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    tree: list[psutil.Process] = []
    try:
        wait_ready(shell, http, log)
        tree = [psutil.Process(shell.pid), *psutil.Process(shell.pid).children(recursive=True)]
        cmdlines = [" ".join(p.cmdline()) for p in tree]
        assert any("kvlifecycle.store" in c for c in cmdlines), f"no store process: {cmdlines}"
        assert any("tritonserver --model-repository" in c for c in cmdlines), f"no tritonserver: {cmdlines}"

        control = f"ipc://{run_dir / 'control.sock'}"
        first = request(1, 200)  # 12 full pages, offloaded after the answer
        served_ok([first], grpc)
        wait_drained(control)
        served_ok([request(2, 240)], grpc)  # 15 pages: pushes user 1's pages out of the pool
        wait_drained(control)
        served_ok([grown(first, 2)], grpc)  # user 1 again: its pages come back from the store

        deadline = time.monotonic() + 10  # Triton pulls the metrics every second or so
        while kv_metric(metrics, "hstu_kv_lookups_total", model=LOOKUP, outcome="host_hit") < 1:
            assert time.monotonic() < deadline, f"no host hit:\n{tail(log)}"
            time.sleep(0.5)
        copied = lambda: (kv_metric(metrics, "hstu_kv_onboarded_pages_total"),  # noqa: E731
                          kv_metric(metrics, "hstu_kv_onboard_failed_pages_total"))
        while copied()[0] < 1:  # hstu_compute's copies (the default), published every second or so
            assert time.monotonic() < deadline + 10, f"no page onboarded (copied, recomputed: {copied()}):\n{tail(log)}"
            time.sleep(0.5)
        assert kv_metric(metrics, "hstu_kv_store_errors_total") == 0, tail(log)
    finally:
        left = stop_group(shell, tree)
    assert not left, f"left behind: {left}"


def test_default_settings_agree_on_a_private_run_dir_and_no_store(tmp_path: Path) -> None:
    from deploy.runtime.settings import ServingSettings

    env = {"XDG_RUNTIME_DIR": str(tmp_path)}
    a, b = ServingSettings.from_env(env), ServingSettings.from_env(dict(env))
    assert a.run_dir == b.run_dir == tmp_path / "hstu-serve"
    assert a.store == "none"
    assert ServingSettings.from_env({}).run_dir == Path(f"/tmp/hstu-serve-{os.getuid()}")
    a.prepare_run_dir()
    b.prepare_run_dir()  # the second model finds it made
    assert stat.S_IMODE(os.lstat(a.run_dir).st_mode) == 0o700


def test_min_host_pages_reaches_the_cache_owner_and_a_bad_one_names_its_variable(tmp_path: Path) -> None:
    """--min-host-pages (HSTU_MIN_HOST_PAGES): below it the owner recomputes instead of onboarding."""
    from compute import HSTUConfig
    from deploy.runtime.cache_owner import open_kv_cache
    from deploy.runtime.settings import MIN_HOST_PAGES_BY_DEVICE, ServingSettings

    settings = ServingSettings.from_env({"XDG_RUNTIME_DIR": str(tmp_path), "HSTU_MIN_HOST_PAGES": "9",
                                         "HSTU_POOL_PAGES": "16"})
    cache = open_kv_cache(HSTUConfig.load(DEFAULT_MODEL_DIR), settings, namespace="ns")
    try:
        assert cache.manager.min_host_pages == 9
    finally:
        cache.close()
    with pytest.raises(ValueError, match="HSTU_MIN_HOST_PAGES=-1"):
        ServingSettings(min_host_pages=-1)
    # Unset (0), it is the device's measured default, and that number travels to every process.
    for device, pages in MIN_HOST_PAGES_BY_DEVICE.items():
        chosen = ServingSettings(device=device)
        assert chosen.min_host_pages == pages and ServingSettings.from_env(chosen.to_env()).min_host_pages == pages


def test_cuda_graphs_travels_in_the_environment_and_a_bad_one_names_its_variable(tmp_path: Path) -> None:
    """--cuda-graphs (HSTU_CUDA_GRAPHS): what hstu-serve sets is what hstu_compute reads."""
    from deploy.runtime.settings import ServingSettings

    env = ServingSettings(run_dir=tmp_path, cuda_graphs=8).to_env()
    assert env["HSTU_CUDA_GRAPHS"] == "8"
    assert ServingSettings.from_env(env).cuda_graphs == 8
    with pytest.raises(ValueError, match="HSTU_CUDA_GRAPHS=-1"):
        ServingSettings(cuda_graphs=-1)


def test_the_shipped_compute_version_serves_the_model_the_server_was_given(tmp_path: Path) -> None:
    """`hstu_compute/1/` holds the default model; a server given another (HSTU_MODEL_DIR, as
    `--model-config` sets it) must serve that one, and a rollout's version folder its own."""
    from deploy.runtime.settings import ServingSettings

    given = ServingSettings(model_dir=tmp_path / "given")
    assert given.compute_model_dir(DEFAULT_MODEL_DIR) == tmp_path / "given"
    assert ServingSettings().compute_model_dir(DEFAULT_MODEL_DIR) == DEFAULT_MODEL_DIR
    rollout, bare = tmp_path / "2", tmp_path / "3"
    rollout.mkdir(), bare.mkdir()
    (rollout / "hstu_config.json").write_text((DEFAULT_MODEL_DIR / "hstu_config.json").read_text())
    assert given.compute_model_dir(rollout) == rollout
    assert given.compute_model_dir(bare) == tmp_path / "given"


def test_a_run_dir_others_can_reach_is_refused(tmp_path: Path) -> None:
    from deploy.runtime.settings import ServingSettings

    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o755)
    with pytest.raises(PermissionError, match="HSTU_RUN_DIR=.*mode 755.*chmod 700"):
        ServingSettings(run_dir=shared).prepare_run_dir()
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(private)
    with pytest.raises(PermissionError, match="not a directory"):
        ServingSettings(run_dir=link).prepare_run_dir()
