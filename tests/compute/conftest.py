"""Fixtures for compute tests: one model folder with a built AOTI package per session.

- ``model_dir``: a tmp folder with the default config, the seeded checkpoint and ``hstu_cpu.pt2``
  (built once per session, ~30-50 s on 2 cores).
- ``config``, ``scorer``, ``eager``, ``compiled``: its config, the reference scorer and the two
  runners; ``runner`` is parametrized over eager and AOTI.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from compute import HSTUConfig, build, load_compiled, load_eager, load_reference


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("hstu_compute")
    HSTUConfig().save(folder)
    build(folder, "cpu")
    return folder


@pytest.fixture(scope="session")
def config(model_dir) -> HSTUConfig:
    return HSTUConfig.load(model_dir)


@pytest.fixture(scope="session")
def scorer(model_dir):
    return load_reference(model_dir)


@pytest.fixture(scope="session")
def eager(model_dir):
    return load_eager(model_dir, "cpu")


@pytest.fixture(scope="session")
def compiled(model_dir):
    return load_compiled(model_dir, "cpu")


@pytest.fixture(params=["eager", "aoti"])
def runner(request, eager, compiled):
    """Each paged test runs over the eager module and over the AOTI package."""
    return eager if request.param == "eager" else compiled
