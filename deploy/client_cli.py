"""`hstu-client`: send one request, or replay a JSONL trace, to `hstu_ranking` (or `hstu_monolithic`);
optionally check every response against the reference scorer."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from deploy import trace as trace_mod
from deploy.client import ROUTE_HEADER
from deploy.replay import replay
from deploy.runtime.schema import ENSEMBLE, RankingRequest
from deploy.score_check import CheckFailed, check_scores


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="hstu-client", description="Send ranking requests to hstu_ranking.")
    p.add_argument("--url", help="host:port (default 127.0.0.1:8001 for gRPC, :8000 with --http)")
    p.add_argument("--http", action="store_true", help="use HTTP /generate instead of unary gRPC")
    p.add_argument("--stream", action="store_true",
                   help="use a gRPC stream instead of unary gRPC (only against a server whose lifecycle steps take "
                        "one request per execute: tritonserver 2.51 corrupts batched inputs that came on streams)")
    p.add_argument("--model", default=ENSEMBLE, help="hstu_ranking or hstu_monolithic")
    p.add_argument("--trace", type=Path, help="JSONL trace (see hstu-trace)")
    p.add_argument("--user", type=int, help="user id (single request mode)")
    p.add_argument("--items", help="comma-separated item ids, oldest first")
    p.add_argument("--actions", help="comma-separated action ids, one per item")
    p.add_argument("--candidates", help="comma-separated candidate item ids")
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--processes", type=int, default=1,
                   help="spread the clients over this many processes, each owning whole users (one Python "
                        "process cannot drive a fast server)")
    p.add_argument("--route-header", nargs="?", const=ROUTE_HEADER, default=None, metavar="NAME",
                   help=f"carry the user id in this header (default {ROUTE_HEADER}) for a routing proxy "
                        "(hstu-cluster); each worker owns whole users (with --stream: one stream per user)")
    p.add_argument("--check", action="store_true", help="compare every response with the reference scorer")
    p.add_argument("--model-repository", default="model_repository")
    p.add_argument("--tolerance", type=float, default=1e-4)
    a = p.parse_args(argv)
    url = a.url or ("127.0.0.1:8000" if a.http else "127.0.0.1:8001")

    if a.trace:
        trace = trace_mod.load(a.trace)
    elif a.user is not None and a.items and a.actions and a.candidates:
        ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
        trace = [RankingRequest(a.user, ints(a.items), ints(a.actions), ints(a.candidates))]
    else:
        p.error("give --trace FILE, or --user, --items, --actions and --candidates")

    result = replay(trace, url, model=a.model, concurrency=a.concurrency, http=a.http, stream=a.stream,
                    route_header=a.route_header, processes=a.processes)
    if len(trace) == 1 and result.scores:
        print(json.dumps({"scores": result.scores[0].tolist()}))
    print(f"{a.model}: {len(result.scores)}/{len(trace)} ok, {len(result.errors)} errors, "
          f"{result.throughput:.1f} req/s, p50 {result.percentile_ms(50):.1f} ms, "
          f"p99 {result.percentile_ms(99):.1f} ms (concurrency {a.concurrency}, processes {a.processes})")
    for i, err in list(result.errors.items())[:5]:
        print(f"  request {i}: {err}", file=sys.stderr)
    code = 0 if result.failure is None else 1  # failed requests, or nothing scored
    if a.check:
        try:
            worst = check_scores(trace, result, a.model_repository)
        except CheckFailed as e:
            print(f"check vs reference scorer: FAIL ({e})")
            return 1
        ok = worst <= a.tolerance
        print(f"check vs reference scorer: max abs diff {worst:.2e} ({'OK' if ok else 'FAIL'}, tolerance {a.tolerance:g})")
        code = code or (0 if ok else 1)
    return code


if __name__ == "__main__":
    sys.exit(main())
