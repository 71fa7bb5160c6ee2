"""DeepSpeed on CPU neither builds nor loads its shared-memory all-reduce op, which training never calls: the first
DeepSpeed launch on a machine no longer waits 30-45 s for its compile. Launches assert it too
(``tests/recipes/test_real_runs.py``: no "deepspeed_shm_comm_op built" in their output)."""

import deepspeed.ops
import pytest
from deepspeed.comm.torch import build_shm_op

from hf_grpo.distributed.cpu_comm_op import SHM_COMM_OP, skip_unused_cpu_comm_op


@pytest.fixture
def compatible_ops(monkeypatch):
    """DeepSpeed's table of the ops this machine can build, its shm entry probed afresh (an earlier in-process run
    under DeepSpeed may have marked it), restored after the test."""
    from deepspeed.accelerator import get_accelerator

    ops = deepspeed.ops.__compatible_ops__
    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    monkeypatch.setitem(ops, SHM_COMM_OP, builder is not None and builder.is_compatible(verbose=False))
    return ops


def test_under_deepspeed_on_cpu_the_shm_comm_op_is_never_built(compatible_ops, monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    assert compatible_ops[SHM_COMM_OP], "DeepSpeed would not build the op here anyway: the test proves nothing"
    assert skip_unused_cpu_comm_op() is True
    assert build_shm_op() is None  # DeepSpeed's own function, as its communication backend calls it
    assert skip_unused_cpu_comm_op() is False  # once is enough


def test_without_deepspeed_nothing_is_changed(compatible_ops, monkeypatch):
    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED", raising=False)
    before = dict(compatible_ops)
    assert skip_unused_cpu_comm_op(None) is False
    assert compatible_ops == before
