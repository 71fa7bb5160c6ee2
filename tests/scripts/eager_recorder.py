"""A stand-in for ``hf_grpo.training.cuda_graph_recorder.CudaGraphRecorder`` on a CPU
(tests/training/test_training_graphs.py, and the launched scripts next to this file that replay training micro-batches
under DeepSpeed)."""

import contextlib

import torch

from hf_grpo.runtime.graph_capture import deepspeed_engine_hooks_lifted


class EagerRecorder:
    """``training_graphs.CudaGraphRecorder``'s interface on a CPU: a "replay" runs the recorded function again and
    writes its outputs where the recorded ones live, as a graph's replay does. What the CPU cannot check (the
    capture itself) the GPU tests of tests/training/test_training_graphs.py do; everything around it runs here."""

    def new_pool(self):
        return None

    @contextlib.contextmanager
    def side_stream(self):
        yield

    def record(self, fn, pool, model=None):
        # What the real recorder does around a capture, and the capture's own rule: no wait for the device.
        with deepspeed_engine_hooks_lifted(model), device_waits_refused():
            outputs = fn()
        grad_mode = torch.is_grad_enabled()  # a graph keeps the mode it was captured in

        def replay():
            with torch.set_grad_enabled(grad_mode):  # (a training replay runs in the autograd node's forward)
                fresh = fn()
            for static, new in zip(outputs or (), fresh or ()):
                if static is not None:
                    static.detach().copy_(new.detach())

        return replay, outputs

    def random_state(self):
        return torch.get_rng_state()

    def set_random_state(self, state):
        torch.set_rng_state(state)

    def recover(self):
        pass

    @staticmethod
    def device_reason(device):
        return None  # any device: nothing is captured


@contextlib.contextmanager
def device_waits_refused():
    """Inside: DeepSpeed's accelerator refuses ``synchronize``, as a GPU does while a stream captures (on a CPU it
    would return at once, and a capture that the GPU refuses would pass here)."""
    import sys

    if "deepspeed" not in sys.modules:
        yield
        return
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()

    def refused(*args, **kwargs):
        raise RuntimeError("operation not permitted when stream is capturing: a device wait inside a capture")

    accelerator.synchronize = refused  # an instance attribute over the class's method
    try:
        yield
    finally:
        del accelerator.synchronize


def record_eagerly() -> None:
    """Training graphs in this process "recorded" by ``EagerRecorder``, on any device."""
    from hf_grpo.training import graphs

    graphs.CudaGraphRecorder = EagerRecorder
