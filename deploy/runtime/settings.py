"""Serving settings shared by the launcher and the Triton models, carried in the environment.

Each Python-backend model instance is its own process started by tritonserver; the only channel
from the launcher to those processes that also works for a `tritonserver` started by hand is the
environment (`hstu-serve --print-env` prints it). This module is the one place that names those
variables; the models call `ServingSettings.from_env()` once in `initialize`.
"""
from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from compute.config import CONFIG_FILENAME, DEFAULT_MODEL_DIR
from kvlifecycle.leases import LEASE_TTL_S
from kvlifecycle.manager import MIN_HOST_PAGES
from kvlifecycle.rpc import TIMEOUTS, Timeouts, split_host_port
from kvlifecycle.store import STORE_KINDS  # the one list of host store backends (open_store's)

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_MODEL_REPOSITORY = DEFAULT_MODEL_DIR.parents[1]
DEVICES = ("cpu", "cuda")
HOST_HIT_COPIERS = ("reader", "store")

_PREFIX = "HSTU_"


def default_run_dir(env: Mapping[str, str]) -> Path:
    """The run directory when HSTU_RUN_DIR is not set (a tritonserver started by hand).

    Every model process of one tritonserver inherits its environment, so they all compute the
    same path with no variable set; it is per user, so two users' servers never meet in it."""
    runtime = env.get("XDG_RUNTIME_DIR", "")
    if os.path.isabs(runtime):
        return Path(runtime) / "hstu-serve"
    return Path("/tmp") / f"hstu-serve-{os.getuid()}"


# Below these many pages past its device prefix a request recomputes its history instead of
# onboarding it. On an H100 both shipped configs' host hits lost to a miss at 8 pages (256 tokens)
# and the large config's won from 16 (docs/benchmarks/2026-12-07-h100-crossover-and-large-sweep.md);
# on the CPU a host hit paid from 8 pages on, and most at long histories.
MIN_HOST_PAGES_BY_DEVICE = {"cpu": MIN_HOST_PAGES, "cuda": 12}


@dataclass
class ServingSettings:
    """What every model process needs to know about this deployment.

    run_dir holds the deployment's sockets and the published page-pool handle. Its sockets take
    commands without authentication, so it must be private: `prepare_run_dir` creates it 0700
    (or checks an existing one) in every model of the ensemble, and the launcher creates it too.

    The defaults serve a `tritonserver --model-repository model_repository` started with no
    HSTU_* variable: a per-user run dir, and no host store (the device cache alone; kv_lookup_alloc
    logs that once). `hstu-serve` sets every variable, and starts the embedded store.
    """

    run_dir: Path = field(default_factory=lambda: default_run_dir(os.environ))
    device: str = "cpu"
    model_dir: Path = DEFAULT_MODEL_DIR
    store: str = "none"  # none: the device cache alone; embedded: the store at store_endpoint (hstu-serve starts it)
    store_endpoint: str = ""  # embedded, flexkv: ipc://<run_dir>/store.sock; mooncake: master address
    pool_pages: int = 4096  # pages of the ensemble's device pool (and of the monolithic's own)
    lease_ttl_s: float = LEASE_TTL_S  # a lease not committed in this time returns its pages
    store_timeout_s: float = TIMEOUTS.store_rpc_s  # store RPCs on the request path give up after this
    # The fewest pages past the device prefix worth onboarding from the host store; a request with
    # fewer recomputes them. 0: the device's default (MIN_HOST_PAGES_BY_DEVICE), where a host hit
    # started to beat a miss (README, "When a host hit pays"); measure your model and set it.
    min_host_pages: int = 0
    # Who copies a host hit's pages into the ensemble's pool: "reader" (hstu_compute, straight from
    # the embedded store's DRAM tier in shared memory, in the execute that computes the request)
    # or "store" (the store process, polled by kv_lookup_alloc's control thread). A store whose
    # DRAM tier is not shared (flexkv, mooncake, no memfd) always copies itself.
    host_hit_copy: str = "reader"
    # hstu_compute on CUDA: the most CUDA graphs of the compiled forward it keeps, one per bucketed
    # batch shape (compute.graphs; CUDA_GRAPHS is a trace's worth); 0 calls the package directly
    # every time. Ignored on the CPU. Off until measured on the GPU.
    cuda_graphs: int = 0
    # mooncake only, read by the launcher for the store process (the one Mooncake client of a
    # server; no model process runs one): host memory it gives the shared tier (0: the cluster's
    # memory nodes hold every object, so stopping a server loses nothing), and the address other
    # Mooncake nodes reach this host on.
    mooncake_segment_bytes: int = 256 << 20
    mooncake_local_hostname: str = "127.0.0.1"

    def __post_init__(self) -> None:
        self.run_dir = Path(self.run_dir)
        self.model_dir = Path(self.model_dir)
        if self.device not in DEVICES:
            raise ValueError(f"HSTU_DEVICE={self.device!r}: expected one of {DEVICES}")
        if self.store not in STORE_KINDS:
            raise ValueError(f"HSTU_STORE={self.store!r}: expected one of {STORE_KINDS}")
        if self.pool_pages < 2:
            raise ValueError(f"HSTU_POOL_PAGES={self.pool_pages}: need at least 2 pages")
        if self.cuda_graphs < 0:
            raise ValueError(f"HSTU_CUDA_GRAPHS={self.cuda_graphs}: expected >= 0 graphs (0: none)")
        if self.host_hit_copy not in HOST_HIT_COPIERS:
            raise ValueError(f"HSTU_HOST_HIT_COPY={self.host_hit_copy!r}: expected one of {HOST_HIT_COPIERS}")
        if self.min_host_pages == 0:
            self.min_host_pages = MIN_HOST_PAGES_BY_DEVICE[self.device]
        if self.min_host_pages < 1:
            raise ValueError(f"HSTU_MIN_HOST_PAGES={self.min_host_pages}: expected >= 1 page (0: the device's "
                             f"default, {MIN_HOST_PAGES_BY_DEVICE})")
        for name in ("lease_ttl_s", "store_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"HSTU_{name.upper()}={getattr(self, name)}: expected > 0 seconds")
        if self.store in ("embedded", "flexkv") and not self.store_endpoint:
            self.store_endpoint = f"ipc://{self.run_dir / 'store.sock'}"
        if self.store == "flexkv" and self.device != "cuda":
            raise ValueError(f"HSTU_STORE=flexkv with HSTU_DEVICE={self.device}: FlexKV copies between the GPU "
                             "page pool and host memory; serve with --device cuda, or use --store embedded")
        if self.store == "mooncake" and not _is_host_port(self.store_endpoint):
            raise ValueError(f"HSTU_STORE_ENDPOINT={self.store_endpoint!r}: the mooncake store needs its "
                             "master's address HOST:PORT (hstu-serve --mooncake-master)")
        if self.mooncake_segment_bytes < 0:
            raise ValueError(f"HSTU_MOONCAKE_SEGMENT_BYTES={self.mooncake_segment_bytes}: expected >= 0")

    @property
    def timeouts(self) -> Timeouts:
        """Every wait on another process (`kvlifecycle.rpc.Timeouts`), from HSTU_STORE_TIMEOUT_S."""
        return Timeouts(store_rpc_s=self.store_timeout_s)

    @property
    def store_socket(self) -> str:
        """The store process the models' clients talk to. embedded: `store_endpoint`. mooncake: the
        store process hstu-serve starts in front of the master at `store_endpoint` (the Mooncake
        client runs there, never in a model process: a dead master costs a store timeout)."""
        return f"ipc://{self.run_dir / 'store.sock'}" if self.store == "mooncake" else self.store_endpoint

    @property
    def control_endpoint(self) -> str:
        """kv_lookup_alloc's control socket (commits, offload completions, aborts)."""
        return f"ipc://{self.run_dir / 'control.sock'}"

    @property
    def pool_handle_path(self) -> Path:
        """Where kv_lookup_alloc publishes the page pool's handle for the other models."""
        return self.run_dir / "pool.json"

    @property
    def compute_version_path(self) -> Path:
        """Where each hstu_compute version publishes its version and KV namespace when it loads."""
        return self.run_dir / "compute_version.json"

    def compute_model_dir(self, version_dir: Path) -> Path:
        """The model an hstu_compute version folder serves: its own when it holds one (a rollout's
        new weights), else model_dir. The shipped version folder is model_dir's default and holds
        the default model; it serves model_dir, so a server given another model serves that one."""
        if not (version_dir / CONFIG_FILENAME).exists() or version_dir.resolve() == DEFAULT_MODEL_DIR.resolve():
            return self.model_dir
        return version_dir

    def prepare_run_dir(self) -> Path:
        """Create run_dir with mode 0700, or check that an existing one is a directory (not a
        symlink) of this user that nobody else can enter. Models load in parallel: whichever
        comes first creates it. Raises PermissionError naming the problem and the fix."""
        path = self.run_dir
        try:
            path.mkdir(mode=0o700, parents=True)
            os.chmod(path, 0o700)  # mkdir's mode is cut by the umask; never widened, but be exact
        except FileExistsError:
            pass
        st = os.lstat(path)
        mode = stat.S_IMODE(st.st_mode)
        problem = None
        if not stat.S_ISDIR(st.st_mode):
            problem = "is not a directory (a symlink or a file)"
        elif st.st_uid != os.getuid():
            problem = f"belongs to uid {st.st_uid}, not to this user (uid {os.getuid()})"
        elif mode & 0o077:
            problem = f"has mode {mode:o}: other users can reach its sockets"
        if problem is not None:
            raise PermissionError(f"{_PREFIX}RUN_DIR={path} {problem}; the run directory must be private to "
                                  f"this user: chmod 700 it, or set {_PREFIX}RUN_DIR to a path that does not exist yet")
        return path

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "ServingSettings":
        """The settings from HSTU_* variables; every unset one takes its default (`default_run_dir`
        from this same environment, so every process of one tritonserver agrees on it)."""
        env = os.environ if env is None else env
        kwargs: dict[str, object] = {"run_dir": default_run_dir(env)}
        for f in fields(cls):
            raw = env.get(_PREFIX + f.name.upper())
            if raw is None:
                continue
            kwargs[f.name] = _parse(f.name, raw, type(f.default))
        return cls(**kwargs)

    def to_env(self) -> dict[str, str]:
        return {_PREFIX + k.upper(): str(v) for k, v in asdict(self).items()}


def _is_host_port(address: str) -> bool:
    try:
        split_host_port(address)
    except ValueError:
        return False
    return True


def _parse(name: str, raw: str, kind: type) -> object:
    try:
        if kind is int:
            return int(raw)
        if kind is float:
            return float(raw)
        return raw
    except ValueError as e:
        raise ValueError(f"{_PREFIX}{name.upper()}={raw!r}: expected {kind.__name__}") from e
