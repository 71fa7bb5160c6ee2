"""Shared fixtures: no test sees the caller's DIFFU_* overrides or a launcher's WORLD_SIZE."""

import pytest

from hf_grpo.config import ENV_OVERRIDES


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
