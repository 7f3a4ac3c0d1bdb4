"""kv_offload with late commits, for the reliability tests (test code, never deployed).

`fault_repository()` (tests/reliability/conftest.py) serves this file as `kv_offload/1/model.py`.
It subclasses the real model, loaded from its file (the Python-backend stub does not put the
tests on the import path), and answers as the real one does, but commits a request with
candidate id `HSTU_TEST_SLOW_COMMIT_CANDIDATE` only once the file `HSTU_TEST_COMMIT_HOLD_FILE`
is gone (at most `COMMIT_HOLD_MAX_S` after its answer, under the 30 s lease TTL; at once when
there is no such file): the test decides how long its lease stays LEASED. The user's next
request then finds the previous one's pages still being written, as when a user's two requests
are in flight at once; requests of this kind hold their pages as long as the test wants.
"""
import importlib.util
import os
import threading
import time
from pathlib import Path

from deploy.runtime.compute_plan import ComputePlan
from deploy.runtime.triton_io import input_tensor

SLOW_COMMIT_CANDIDATE = int(os.environ["HSTU_TEST_SLOW_COMMIT_CANDIDATE"])
COMMIT_HOLD_FILE = Path(os.environ["HSTU_TEST_COMMIT_HOLD_FILE"])
COMMIT_HOLD_MAX_S = 20.0
REAL_MODEL = Path(os.environ["HSTU_TEST_REAL_REPOSITORY"]) / "kv_offload" / "1" / "model.py"

_spec = importlib.util.spec_from_file_location("kv_offload_real_model", REAL_MODEL)
_real = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_real)


class TritonPythonModel(_real.TritonPythonModel):
    def initialize(self, args):
        super().initialize(args)
        self._late = set()  # lease ids whose commit is held back
        launch, commit = self.worker.launch, self.worker.commit

        def launch_late_ones_later(lease_ids, token_ids):
            late = [lease_id for lease_id in lease_ids if lease_id in self._late]
            if late:  # committed late, and not offloaded (no history to key the put by): unpinned at once
                def commit_once_released() -> None:
                    deadline = time.monotonic() + COMMIT_HOLD_MAX_S
                    while COMMIT_HOLD_FILE.exists() and time.monotonic() < deadline:
                        time.sleep(0.01)
                    for c in commit(late):
                        self.control.offload_done([it.page_id for it in c.items], False)

                threading.Thread(target=commit_once_released, name="late-commit", daemon=True).start()
            on_time = [(lease_id, tokens) for lease_id, tokens in zip(lease_ids, token_ids) if lease_id not in self._late]
            return launch([lease_id for lease_id, _ in on_time], [tokens for _, tokens in on_time])

        self.worker.launch = launch_late_ones_later

    def execute(self, requests):
        for request in requests:
            try:
                plan = ComputePlan.unpack(input_tensor(request, "compute_plan"))
            except Exception:  # the real model answers a malformed request
                continue
            if bool((plan.candidates == SLOW_COMMIT_CANDIDATE).any()):
                self._late.add(plan.lease_id)
        return super().execute(requests)
