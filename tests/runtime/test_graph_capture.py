"""No garbage collection inside a CUDA-graph capture (``runtime.graph_capture.collection_paused``).

torch >= 2.9 does not collect before a capture; a collection that starts inside one can destroy an earlier graph
left in a reference cycle, which fails the capture at random. The captures themselves need a GPU: here the
device calls are stood in, and what is checked is that the captured function runs with the collector off.
"""

from __future__ import annotations

import gc
from contextlib import contextmanager

import pytest
import torch

from hf_grpo.runtime import graph_capture
from hf_grpo.runtime.graph_capture import collection_paused
from hf_grpo.training.cuda_graph_recorder import CudaGraphRecorder


class Finalized:
    """Garbage only the cyclic collector frees (it refers to itself); ``freed`` says when it was."""

    freed: list[str] = []

    def __init__(self, name: str):
        self.name, self.me = name, self

    def __del__(self):
        Finalized.freed.append(self.name)


@pytest.fixture
def collector_on():
    was_enabled, thresholds = gc.isenabled(), gc.get_threshold()
    gc.enable()
    gc.collect()
    Finalized.freed.clear()
    yield
    gc.set_threshold(*thresholds)
    (gc.enable if was_enabled else gc.disable)()


def test_no_automatic_collection_frees_cyclic_garbage_inside_the_block(collector_on):
    gc.set_threshold(10, 1, 1)  # a collection every few allocations, of every generation
    Finalized("stale graph")  # garbage in a cycle, made before the capture
    with collection_paused():
        churn = [[index] for index in range(10_000)]  # what a capture allocates: would trigger collections
        assert Finalized.freed == [] and not gc.isenabled()
    del churn
    assert gc.isenabled()
    gc.collect()
    assert Finalized.freed == ["stale graph"]  # freed after, outside the capture


def test_the_collector_is_left_as_it_was_also_after_an_error(collector_on):
    with pytest.raises(RuntimeError), collection_paused():
        raise RuntimeError("a capture that failed")
    assert gc.isenabled()
    gc.disable()  # a user's script that manages collections itself keeps it off
    with collection_paused():
        pass
    assert not gc.isenabled()


class _FakeGraph:
    def replay(self):
        pass


@contextmanager
def _fake_capture(graph, **kwargs):
    yield


class _FakeStream:
    def wait_stream(self, other):
        pass


def test_the_training_recorder_captures_with_the_collector_off(collector_on, monkeypatch):
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", _fake_capture)
    recorder = CudaGraphRecorder()
    monkeypatch.setattr(recorder, "stream", lambda: None)
    replay, outputs = recorder.record(lambda: gc.isenabled(), pool=None)
    assert outputs is False and gc.isenabled()  # off while captured, on again after
    replay()


def test_the_decoders_capture_with_the_collector_off(collector_on, monkeypatch):
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", _fake_capture)
    monkeypatch.setattr(torch.cuda, "stream", _fake_capture)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *args: _FakeStream())
    monkeypatch.setattr(graph_capture, "capture_stream", lambda device: _FakeStream())
    calls = []
    graph, captured = graph_capture.capture_graph(lambda: calls.append(gc.isenabled()) or len(calls),
                                                  torch.nn.Linear(2, 2), torch.device("cpu"), warmups=2)
    assert calls == [True, True, False] and captured == 3  # the warm-ups collect as usual; the capture does not
    assert gc.isenabled()
