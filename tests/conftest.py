"""Shared fixtures: no test sees the caller's DIFFU_* overrides or a launcher's WORLD_SIZE; every subprocess sees
this virtualenv activated."""

import os
import pathlib
import sys

import pytest
from tests.launching import note_running_test

from hf_grpo.config import ENV_OVERRIDES


def _activate_this_virtualenv() -> None:
    """Put this virtualenv's bin first on PATH for every subprocess, as the README's ``. .venv/bin/activate`` does.

    DeepSpeed JIT-builds its CPU ops with whichever ``ninja`` is first on PATH. A pytest started without activating
    the virtualenv would build with the machine's ninja (e.g. /usr/bin/ninja 1.11) in most launches but with the
    virtualenv's (pip's ninja 1.13) in the documented commands, which run activated: each ninja rebuilds what the
    other built, ~45 s on every switch."""
    bin_dir = str(pathlib.Path(sys.executable).parent)
    path = os.environ.get("PATH", "")
    if path.split(os.pathsep)[0] != bin_dir:
        os.environ["PATH"] = f"{bin_dir}{os.pathsep}{path}"


_activate_this_virtualenv()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Before the test's fixtures are set up: a fixture that launches processes checks the test that asked for it
    (tests/launching.py refuses a multi-process launch for a test not marked ``launch``)."""
    note_running_test(item)


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    note_running_test(None)


@pytest.fixture(autouse=True)
def _clean_batch_env(monkeypatch):
    for variable in (*ENV_OVERRIDES, "WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(variable, raising=False)


@pytest.fixture
def make_config(tmp_path):
    """Build an hf_grpo.GRPOConfig for CPU with test-friendly defaults; keyword arguments win."""
    from hf_grpo import GRPOConfig

    def make(**overrides):
        values = dict(output_dir=str(tmp_path / "out"), report_to=[], use_cpu=True, bf16=False)
        values.update(overrides)
        return GRPOConfig(**values)

    return make



@pytest.fixture(scope="session")
def zero2_quickstart_run(tmp_path_factory):
    """The quickstart launched once under the shipped zero2.yaml on 2 processes (test_launch.ZERO2_QUICKSTART: 6 steps,
    a checkpoint every 2, all kept): the uninterrupted run a killed-and-resumed one must equal (test_fault_resume),
    and a checkpoint of 2 ZeRO partitions that a 1-process resume must refuse (test_zero_resume). Launched by the
    first test that asks for it: each of those is marked ``launch``."""
    from tests.distributed.test_launch import ZERO2_QUICKSTART, launch

    output_dir = tmp_path_factory.mktemp("zero2_quickstart") / "out"
    launch("zero2", "recipes/quickstart.py", *ZERO2_QUICKSTART, "--output_dir", output_dir)
    return output_dir
