"""hstu_compute with one injected fault, for the reliability tests (test code, never deployed).

`fault_repository()` (tests/reliability/conftest.py) serves this file as
`hstu_compute/1/model.py` of a test model repository whose other models are the real ones. It
subclasses the real model, loaded from its file (the Python-backend stub does not put the
tests on the import path), and raises `InjectedFault` while scoring any batch that holds a
request with candidate id `HSTU_TEST_FAULT_CANDIDATE`, so that request fails and the rest of its batch is
retried without it.
"""
import importlib.util
import os
from pathlib import Path

FAULT_CANDIDATE = int(os.environ["HSTU_TEST_FAULT_CANDIDATE"])
REAL_MODEL = Path(os.environ["HSTU_TEST_REAL_REPOSITORY"]) / "hstu_compute" / "1" / "model.py"

_spec = importlib.util.spec_from_file_location("hstu_compute_real_model", REAL_MODEL)
_real = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_real)


class InjectedFault(RuntimeError):
    """A failure injected on purpose by a reliability test."""


class TritonPythonModel(_real.TritonPythonModel):
    def _launch(self, pool, items):
        for i, item in enumerate(items):
            if bool((item.candidates == FAULT_CANDIDATE).any()):
                raise InjectedFault(f"injected fault (test): candidate {FAULT_CANDIDATE} in request {i} of the batch")
        return super()._launch(pool, items)
