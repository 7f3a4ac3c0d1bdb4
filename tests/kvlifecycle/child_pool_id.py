"""Another process's view of a pool's id: attach the pool from its handle and name it the way the
store server and kv_offload's store client do. Payload: {"handle"}. Prints {"of_handle": pool_id of
the handle as received, "of_attached": pool_id of the attached pool's own handle()}."""

import json
import sys

from kvlifecycle.pool import PagePool
from kvlifecycle.store.protocol import pool_id


def main() -> None:
    handle = json.loads(sys.argv[1])["handle"]
    pool = PagePool.attach(handle)
    out = {"of_handle": pool_id(handle), "of_attached": pool_id(pool.handle())}
    pool.close()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
