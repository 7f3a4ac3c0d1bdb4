"""hstu-serve beyond loopback: HTTP and gRPC go through the nginx front (deploy/front.py).

One `hstu-serve --host 0.0.0.0`, started as a user starts it. The front listens on every address;
the test connects through 127.0.0.1 only. tritonserver and its metrics port listen on 127.0.0.1
only. The bodies that crash tritonserver 2.51 get refused by the front: a form-encoded body over
4 MB (the strict xfail `test_huge_form_encoded_http_body_gets_an_error_and_the_server_stays_up` in
tests/reliability/test_bad_input.py) a 413, an input's data nested 100,000 lists deep a 400. A
mistyped JSON value gets a 400 naming the input, administration and shared-memory calls a 403, and
the same tritonserver keeps serving correct scores. Ctrl-C stops nginx too.
"""
from __future__ import annotations

import contextlib
import http.client
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from deploy.client import RankingClient, RequestFailed
from deploy.cluster import Cluster, ClusterConfig
from deploy.front import MAX_BODY_SIZE, MAX_INPUT_DEPTH, write_nginx_conf
from deploy.launcher import LaunchConfig, Server
from deploy.runtime.schema import ENSEMBLE, RankingRequest
from deploy.runtime.settings import ServingSettings
from tests.conftest import REPO_ROOT, free_ports
from tests.helpers import assert_scores_match

pytestmark = pytest.mark.integration

TOLERANCE = 1e-4
VALID = {"user_id": [7], "item_ids": [11, 12, 13], "action_ids": [1, 0, 2], "candidate_ids": [21, 22]}
HUGE = 3_000_000  # events: the 12 MB body of the direct-path xfail
GENERATE = f"/v2/models/{ENSEMBLE}/generate"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The module's running `hstu-serve --host 0.0.0.0` (no test stops it)."""
    with fronted_server(tmp_path_factory.mktemp("front")) as server:
        yield server


@contextlib.contextmanager
def fronted_server(base: Path):
    """`hstu-serve --host 0.0.0.0` under `base`: its ports, endpoints line and process tree; stopped
    with Ctrl-C on exit if still running."""
    run_dir = base / "run"
    http, grpc, metrics, triton_http, triton_grpc = free_ports(5)
    cmd = [str(Path(sys.executable).parent / "hstu-serve"), "--host", "0.0.0.0", "--http-port", str(http),
           "--grpc-port", str(grpc), "--metrics-port", str(metrics), "--triton-http-port", str(triton_http),
           "--triton-grpc-port", str(triton_grpc), "--run-dir", str(run_dir)]
    launcher = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        endpoints, output = None, []
        deadline = time.monotonic() + 600
        while endpoints is None and time.monotonic() < deadline:
            line = launcher.stdout.readline()
            assert line, f"hstu-serve exited early with {launcher.wait()}:\n{''.join(output[-40:])}"
            output.append(line)
            if line.startswith("{"):
                endpoints = json.loads(line)
        assert endpoints is not None, "hstu-serve not ready in 600 s"
        tree = psutil.Process(launcher.pid).children(recursive=True)
        yield {"launcher": launcher, "endpoints": endpoints, "tree": tree, "run_dir": run_dir,
               "http": f"127.0.0.1:{http}", "grpc": f"127.0.0.1:{grpc}", "ports": (http, grpc, metrics),
               "triton_ports": (triton_http, triton_grpc), "triton": _one(tree, "tritonserver"),
               "nginx": psutil.Process(endpoints["front"]["nginx_pid"])}
    finally:
        if launcher.poll() is None:
            launcher.send_signal(signal.SIGINT)
            try:
                launcher.wait(timeout=120)
            except subprocess.TimeoutExpired:
                launcher.kill()
                launcher.wait()


def test_tritonserver_and_metrics_stay_on_loopback_and_nginx_serves_the_host(served) -> None:
    http, grpc, metrics = served["ports"]
    triton_http, triton_grpc = served["triton_ports"]
    assert _listening(served["triton"]) == {("127.0.0.1", triton_http), ("127.0.0.1", triton_grpc),
                                            ("127.0.0.1", metrics)}
    assert _listening(served["nginx"]) == {("0.0.0.0", http), ("0.0.0.0", grpc)}
    assert served["endpoints"]["metrics"] == f"http://127.0.0.1:{metrics}/metrics"


def test_scores_through_the_front_match_the_reference(served, reference) -> None:
    _check_serving(served, reference, user_id=101)


def test_crashing_form_encoded_body_gets_413_and_the_server_keeps_serving(served, reference) -> None:
    body = json.dumps({**VALID, "item_ids": [1] * HUGE, "action_ids": [0] * HUGE}, separators=(",", ":")).encode()
    assert len(body) > 4_000_000

    status, text = _post(served["http"], GENERATE, body, content_type="application/x-www-form-urlencoded")

    assert status == 413, f"HTTP {status}: {text[:200]}"
    time.sleep(0.5)
    assert served["triton"].is_running() and served["triton"].status() != psutil.STATUS_ZOMBIE
    _check_serving(served, reference, user_id=102)


def test_body_just_over_the_cap_gets_413_and_one_under_reaches_the_model(served) -> None:
    cap = int(MAX_BODY_SIZE.removesuffix("m")) << 20
    padded = json.dumps({**VALID, "candidate_ids": [-1]}).encode()
    under = padded[:-1] + b" " * (cap - len(padded)) + b"}"  # JSON whitespace up to the cap
    assert _post(served["http"], GENERATE, under + b" ")[0] == 413
    status, text = _post(served["http"], GENERATE, under)
    assert status == 400 and "candidate_ids" in text, f"HTTP {status}: {text[:200]}"  # the model's own check


DEEP = 100_000  # lists: tritonserver 2.51 segfaults flattening an input's data nested this deep (10,000: served)


def test_deeply_nested_input_data_gets_400_and_the_server_keeps_serving(served, reference) -> None:
    deep = "[" * DEEP + "3" + "]" * DEEP
    generate = ('{"user_id": [7], "action_ids": [1], "candidate_ids": [2], "item_ids": %s}' % deep).encode()
    infer = json.dumps({"inputs": [{"name": t, "shape": [1], "datatype": "INT64", "data": "DATA"}
                                   for t in ("user_id", "item_ids", "action_ids", "candidate_ids")]})
    infer = infer.replace('"DATA"', deep, 1).replace('"DATA"', "[1]").encode()

    status, text = _post(served["http"], GENERATE, generate)
    assert status == 400 and "'item_ids'" in text, f"HTTP {status}: {text[:300]}"
    status, text = _post(served["http"], f"/v2/models/{ENSEMBLE}/infer", infer)
    assert status == 400 and "nest at most" in text, f"HTTP {status}: {text[:300]}"
    too_deep = {**VALID, "item_ids": [11, 12, 13]}
    for _ in range(MAX_INPUT_DEPTH):
        too_deep["item_ids"] = [too_deep["item_ids"]]
    status, text = _post(served["http"], GENERATE, json.dumps(too_deep).encode())
    assert status == 400 and "'item_ids'" in text, f"HTTP {status}: {text[:300]}"

    time.sleep(0.5)
    assert served["triton"].is_running() and served["triton"].status() != psutil.STATUS_ZOMBIE
    _check_serving(served, reference, user_id=104)


def test_administration_and_shared_memory_are_refused(served) -> None:
    for path, body in (("/v2/repository/index", b"{}"), (f"/v2/repository/models/{ENSEMBLE}/unload", b"{}"),
                       ("/v2/systemsharedmemory/region/pool/register", b'{"key": "/x", "offset": 0, "byte_size": 8}'),
                       ("/v2/logging", b'{"log_verbose_level": 1}')):
        status, text = _post(served["http"], path, body)
        assert status == 403, f"{path}: HTTP {status}: {text[:200]}"
    client = grpcclient.InferenceServerClient(served["grpc"])
    try:
        for call in (client.get_model_repository_index, client.get_system_shared_memory_status,
                     lambda: client.unload_model(ENSEMBLE)):
            with pytest.raises(InferenceServerException, match="(?i)permission|403"):
                call()
        assert client.is_model_ready(ENSEMBLE)
    finally:
        client.close()


def test_oversized_header_gets_400(served, reference) -> None:
    status, text = _post(served["http"], GENERATE, json.dumps(VALID).encode(), headers={"x-pad": "a" * 20_000})
    assert status == 400 and "Header" in text, f"HTTP {status}: {text[:200]}"
    _check_serving(served, reference, user_id=103)


MISTYPED = [  # (case, body, the input the error must name)
    ("float item id", {**VALID, "item_ids": [11.5, 12, 13]}, "item_ids"),
    ("string candidate", {**VALID, "candidate_ids": ["21"]}, "candidate_ids"),
    ("bool user id", {**VALID, "user_id": True}, "user_id"),
    ("null actions", {**VALID, "action_ids": None}, "action_ids"),
    ("list of lists with a float", {**VALID, "item_ids": [[11], [12.5], [13]]}, "item_ids"),
    ("object candidate", {**VALID, "candidate_ids": [{"id": 21}]}, "candidate_ids"),
    ("exponent", b'{"user_id": [7], "item_ids": [11, 12, 13], "action_ids": [1, 0, 2], "candidate_ids": [2e1]}',
     "candidate_ids"),
]


@pytest.mark.parametrize("body,field", [c[1:] for c in MISTYPED], ids=[c[0] for c in MISTYPED])
def test_mistyped_json_value_gets_400_naming_the_input(served, body, field: str) -> None:
    data = body if isinstance(body, bytes) else json.dumps(body, indent=1).encode()  # indent: newlines in arrays
    status, text = _post(served["http"], GENERATE, data)
    assert status == 400, f"HTTP {status}: {text[:300]}"
    error = json.loads(text)["error"]
    assert f"'{field}'" in error and "INT64" in error, error

    # tritonserver alone refuses these too, naming nothing.
    direct_status, direct_text = _post(f"127.0.0.1:{served['triton_ports'][0]}", GENERATE, data)
    assert direct_status >= 400 and field not in direct_text, f"tritonserver: HTTP {direct_status}: {direct_text[:300]}"


def test_well_typed_bodies_pass_the_check(served, reference) -> None:
    """Scalars, spacing, key order and nested lists (tritonserver flattens them) are not flagged;
    bad values of the right type still get the models' own 400 naming the field."""
    expected = reference.score(7, [11, 12, 13], [1, 0, 2], [21, 22]).ravel().tolist()
    for body in (b'{ "candidate_ids" : [ 21 ,22 ] ,\n "user_id":7, "action_ids":[1,0,2],"item_ids":\t[11,12,13]}',
                 json.dumps({**VALID, "item_ids": [[11], [12], [13]]}).encode()):
        status, text = _post(served["http"], GENERATE, body)
        assert status == 200, f"HTTP {status}: {text[:300]}"
        scores = json.loads(text)["scores"]
        assert len(scores) == len(expected), scores
        assert max(abs(a - b) for a, b in zip(scores, expected)) <= TOLERANCE, (scores, expected)

    status, text = _post(served["http"], GENERATE, json.dumps({**VALID, "candidate_ids": [-5]}).encode())
    assert status == 400 and "candidate_ids" in text and "-5" in text, f"HTTP {status}: {text[:300]}"


def test_ctrl_c_stops_nginx_and_leaves_no_process(tmp_path: Path) -> None:
    with fronted_server(tmp_path) as served:  # its own server: the module's keeps serving the other tests
        launcher, tree = served["launcher"], served["tree"]
        assert "nginx" in " ".join(p.name() for p in tree)

        launcher.send_signal(signal.SIGINT)
        assert launcher.wait(timeout=120) == 0

    time.sleep(0.5)
    alive = [p for p in tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"left behind: {[(p.pid, p.name()) for p in alive]}"


# ---- without a server ----------------------------------------------------------------------------

@pytest.mark.parametrize("host,fronted", [("127.0.0.1", False), ("localhost", False), ("::1", False),
                                          ("127.0.0.2", False), ("0.0.0.0", True), ("::", True),
                                          ("10.1.2.3", True), ("serving.example", True)])
def test_the_front_serves_exactly_beyond_loopback(host: str, fronted: bool) -> None:
    assert LaunchConfig(host=host).fronted is fronted


def test_hstu_serve_and_hstu_cluster_render_the_same_front(tmp_path: Path) -> None:
    server = Server(LaunchConfig(ServingSettings(run_dir=tmp_path / "serve", store="embedded"), host="0.0.0.0",
                                 triton_http_port=9100, triton_grpc_port=9101))
    cluster = Cluster(ClusterConfig(num_servers=2, run_dir=tmp_path / "cluster"))
    assert "--http-address=127.0.0.1" in server.triton_command() and "--grpc-port=9101" in server.triton_command()
    assert all(srv.config.host == "127.0.0.1" for srv in cluster.servers)
    confs = {}
    for name, prefix, text in (("serve", server.nginx_dir, server.front_conf()),
                               ("cluster", cluster.nginx_dir, cluster.render_nginx_conf())):
        write_nginx_conf(prefix, text)  # nginx -t accepts it
        confs[name] = text
    body = lambda text: text[text.index("map $request_body"):text.index("upstream hstu_grpc")]  # noqa: E731
    assert body(confs["serve"]) == body(confs["cluster"])  # the same checks, from one template
    assert "server 127.0.0.1:9100 " in confs["serve"] and "listen 0.0.0.0:" in confs["serve"]


def test_print_env_beyond_loopback_starts_the_front_by_hand(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    out = subprocess.run([str(Path(sys.executable).parent / "hstu-serve"), "--print-env", "--host", "0.0.0.0",
                          "--run-dir", str(run_dir)], cwd=REPO_ROOT, capture_output=True, text=True, check=True).stdout
    lines = out.splitlines()
    triton = next(line for line in lines if "tritonserver --model-repository=" in line)
    assert "--http-address=127.0.0.1" in triton and "--grpc-address=127.0.0.1" in triton
    assert "--metrics-address=127.0.0.1" in triton
    assert any(line.startswith("kill $front") for line in lines)
    # The recipe's nginx.conf, written as printed, is one nginx accepts.
    start = next(i for i, line in enumerate(lines) if line.endswith("<<'HSTU_NGINX_CONF'"))
    end = lines.index("HSTU_NGINX_CONF", start)
    recipe = "\n".join([f"mkdir -p -m 700 {run_dir}", *lines[start - 1:end + 1]])
    subprocess.run(["bash", "-c", recipe], check=True)
    nginx = next(line for line in lines[end:] if line.endswith(" &")).removesuffix(" &")
    check = subprocess.run(f"{nginx} -t", shell=True, capture_output=True, text=True)
    assert check.returncode == 0, check.stderr


# ---- helpers -------------------------------------------------------------------------------------

def _check_serving(served, reference, user_id: int) -> None:
    """One request on a gRPC stream, on HTTP /generate and on HTTP /infer (binary tensors), all
    through the front, scored as the reference does."""
    request = RankingRequest(user_id, [11, 12, 13, 14], [1, 0, 2, 1], [21, 22, 23])
    expected = reference.score(request.user_id, request.item_ids, request.action_ids, request.candidate_ids)
    for what, url, http in (("gRPC stream", served["grpc"], False), ("HTTP /generate", served["http"], True)):
        with RankingClient(url, http=http, timeout_s=120) as client:
            try:
                scores = client.score(request)
            except RequestFailed as e:
                raise AssertionError(f"{what} through the front failed: {e}") from None
        assert_scores_match(scores, expected, TOLERANCE, what)
    client = httpclient.InferenceServerClient(served["http"])
    try:
        inputs = []
        for name, array in request.arrays().items():
            tensor = httpclient.InferInput(name, list(array.shape), "INT64")
            tensor.set_data_from_numpy(array)  # binary data: a JSON header, then the raw tensors
            inputs.append(tensor)
        scores = client.infer(ENSEMBLE, inputs).as_numpy("scores")
    finally:
        client.close()
    assert_scores_match(scores, expected, TOLERANCE, "HTTP /infer")


def _post(hostport: str, path: str, body: bytes, content_type: str = "application/json",
          headers: dict[str, str] | None = None) -> tuple[int, str]:
    """POST with Content-Length; the status and body, also when the server answers before the
    whole body was sent (nginx's 413 for an announced length over the cap)."""
    host, port = hostport.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    try:
        conn.putrequest("POST", path)
        for k, v in {"Content-Type": content_type, "Content-Length": str(len(body)), **(headers or {})}.items():
            conn.putheader(k, v)
        conn.endheaders()
        try:
            conn.send(body)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the answer is already on its way
        response = conn.getresponse()
        return response.status, response.read().decode(errors="replace")
    finally:
        conn.close()


def _listening(proc: psutil.Process) -> set[tuple[str, int]]:
    """(address, port) of every listening socket (an IPv4-mapped IPv6 address as its IPv4 address:
    tritonserver's gRPC listens on ::ffff:127.0.0.1)."""
    return {(c.laddr.ip.removeprefix("::ffff:"), c.laddr.port)
            for c in proc.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN}


def _one(tree: list[psutil.Process], name: str) -> psutil.Process:
    found = [p for p in tree if p.name() == name]
    assert len(found) == 1, f"{len(found)} {name} processes in {[(p.pid, p.name()) for p in tree]}"
    return found[0]
