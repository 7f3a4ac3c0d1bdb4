"""Process B of the multi-process test: attach the pool, write each lease's new pages, commit
them through the control plane. Payload: {"handle", "endpoint", "leases": [{"lease_id",
"pages", "value"}], "abort": [lease ids]}. Prints {"offload": {lease_id: [items]}, "aborted": [...]}."""

import json
import sys

from kvlifecycle.control import ControlClient
from kvlifecycle.pool import PagePool


def main() -> None:
    payload = json.loads(sys.argv[1])
    pool = PagePool.attach(payload["handle"])
    out = {"offload": {}, "aborted": []}
    with ControlClient(payload["endpoint"], timeout_s=10.0) as client:
        for lease in payload["leases"]:
            for page in lease["pages"]:
                pool.tensor[:, page] = float(lease["value"])  # every layer, K and V
            [committed] = client.commit_many([lease["lease_id"]])
            out["offload"][str(lease["lease_id"])] = [it.to_json() for it in committed.items]
        for lease_id in payload.get("abort", []):
            out["aborted"].append(client.abort(lease_id))
    pool.close()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
