"""The nginx front of tritonserver: rendered from `deploy/nginx.conf.template`, used by
`hstu-cluster` (N servers, routed by user) and by `hstu-serve` when it listens beyond loopback
(one server, which stays on 127.0.0.1).

tritonserver 2.51 has no request limits of its own: it segfaults on an HTTP body over about 4 MB
sent form-encoded, and on an input's JSON data nested about 100,000 lists deep. The front caps
HTTP bodies (413) and headers, times out slow clients, checks /infer and /generate bodies (JSON
nesting; a ranking input's JSON type, answered with a 400 naming the input), and refuses the
administration and shared-memory APIs (see the template for each rule and why).
"""
from __future__ import annotations

import ipaddress
import os
import shutil
import string
import subprocess
from pathlib import Path

from deploy.runtime.schema import ENSEMBLE_INPUTS

NGINX_TEMPLATE = Path(__file__).resolve().parent / "nginx.conf.template"
MAX_BODY_SIZE = "1m"  # HTTP request body cap; a request of 2,048 events and 256 candidates is ~40 KB of JSON
MAX_HEADER_SIZE = "16k"  # one header line (and at most 4 such buffers)
MAX_JSON_DEPTH = 10  # lists and objects of an /infer or /generate body (1-D /infer data: 4)
MAX_INPUT_DEPTH = 4  # lists of one ranking input's value on /generate (tritonserver flattens them)

# PCRE pieces of the body checks, all possessive (no backtracking: linear in the body). They
# check nesting and types, not JSON syntax (tritonserver does that): a scalar is a string or a
# run of number/literal characters. nginx takes a config string of at most 4,096 bytes.
_SCALAR = r'(?:"(?:[^"\\]++|\\.)*+"|[-+.\w]++)'
_INT = r"-?+\d++"


def human_size(nginx_size: str) -> str:
    """An nginx size ("1m", "16k") as people read it ("1 MiB", "16 KiB")."""
    units = {"k": "KiB", "m": "MiB", "g": "GiB"}
    unit = units.get(nginx_size[-1].lower())
    return f"{nginx_size[:-1]} {unit}" if unit else f"{nginx_size} bytes"


def is_loopback(host: str) -> bool:
    """True for localhost and loopback addresses (127.0.0.0/8, ::1): no front needed there."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve beyond loopback


def connect_host(host: str) -> str:
    """An address this machine can connect to for a server bound to `host` (URL form)."""
    if host in ("", "0.0.0.0"):
        return "127.0.0.1"
    if host.strip("[]") == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _nested(leaf: str, depth: int, objects: bool) -> str:
    """A PCRE DEFINE block of groups 1..depth+1: group 1 is `leaf`, group k+1 is `leaf` or a list
    (or, with `objects`, an object keyed by leaves) of group k's values. No group calls itself:
    the nesting is bounded by construction, so matching never recurses deeper than `depth`."""
    groups = [leaf]
    for k in range(1, depth + 1):
        alternatives = ["(?1)", rf"\[\s*+(?:(?{k})\s*+(?:,\s*+(?{k})\s*+)*+)?+\]"]
        if objects:
            member = rf"(?1)\s*+:\s*+(?{k})"
            alternatives.append(rf"\{{\s*+(?:{member}\s*+(?:,\s*+{member}\s*+)*+)?+\}}")
        groups.append("(?:" + "|".join(alternatives) + ")")
    return "(?(DEFINE)" + "".join(f"({g})" for g in groups) + ")"


def json_body_regex(max_depth: int = MAX_JSON_DEPTH) -> str:
    """PCRE: the text starts with a JSON object whose lists and objects nest at most `max_depth`
    deep (what follows it is not looked at: a binary-data /infer body)."""
    return rf"\A\s*+(?=\{{)(?{max_depth + 1})" + _nested(_SCALAR, max_depth, objects=True)


def mistyped_input_regex(name: str, max_depth: int = MAX_INPUT_DEPTH) -> str:
    """PCRE: somewhere the key `name` has a value that is not an integer or a list of integers
    nested at most `max_depth` deep."""
    return rf'"{name}"\s*+:(?!\s*+(?{max_depth + 1})\s*+[,}}])' + _nested(_INT, max_depth, objects=False)


def nginx_string(text: str) -> str:
    r"""`text` as a double-quoted nginx config string (nginx reads \\ as \ and \" as ")."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def render_nginx_conf(prefix: Path, listen_host: str, http_port: int, grpc_port: int,
                      http_servers: list[str], grpc_servers: list[str], worker_processes: int = 1) -> str:
    """nginx.conf for a front listening on listen_host:http_port (HTTP) and :grpc_port (gRPC),
    in front of tritonservers at `http_servers` / `grpc_servers` ("host:port", same order)."""
    if not http_servers or len(http_servers) != len(grpc_servers):
        raise ValueError(f"render_nginx_conf: {len(http_servers)} HTTP vs {len(grpc_servers)} gRPC servers")
    line = "        server {} max_fails=1 fail_timeout=10s;"
    listen = f"[{listen_host}]" if ":" in listen_host and not listen_host.startswith("[") else listen_host
    return string.Template(NGINX_TEMPLATE.read_text()).substitute(
        worker_processes=worker_processes, prefix=prefix, listen_host=listen, grpc_port=grpc_port,
        http_port=http_port, num_servers=len(http_servers), max_body_size=MAX_BODY_SIZE,
        max_header_size=MAX_HEADER_SIZE, max_json_depth=MAX_JSON_DEPTH, max_input_depth=MAX_INPUT_DEPTH,
        inputs=", ".join(t.name for t in ENSEMBLE_INPUTS),
        json_body_regex=nginx_string("~" + json_body_regex()),
        mistyped_input_regexes="\n".join(f"        {nginx_string('~' + mistyped_input_regex(t.name))} {t.name};"
                                          for t in ENSEMBLE_INPUTS),
        grpc_servers="\n".join(line.format(s) for s in grpc_servers),
        http_servers="\n".join(line.format(s) for s in http_servers))


def write_nginx_conf(prefix: Path, conf_text: str, nginx: str = "nginx") -> list[str]:
    """Write `prefix/nginx.conf`, have nginx check it (`nginx -t`), and return the command that
    runs nginx on it in the foreground. RuntimeError when nginx is missing or rejects it."""
    binary = shutil.which(nginx)
    if binary is None:
        raise RuntimeError(f"{nginx!r} not found; deploy/setup.sh installs nginx-light")
    prefix.mkdir(parents=True, exist_ok=True)
    os.chmod(prefix, 0o711)  # nginx's workers (user nobody when started as root) reach their temp dirs inside
    conf = prefix / "nginx.conf"
    conf.write_text(conf_text)
    cmd = nginx_command(binary, prefix)
    check = subprocess.run([*cmd, "-t"], capture_output=True, text=True)
    if check.returncode != 0:
        raise RuntimeError(f"nginx rejected {conf}:\n{check.stderr}")
    return cmd


def nginx_command(binary: str, prefix: Path) -> list[str]:
    return [binary, "-p", str(prefix), "-e", str(prefix / "error.log"), "-c", str(prefix / "nginx.conf")]
