"""Training micro-batches replayed under DistributedDataParallel (hf_grpo.distributed.ddp_replay), in one process
over gloo: DDP's reducer reduces the replay's handed-over gradients as after its own forward, nothing under
``no_sync()``; the settings a replay cannot honour are refused by name, and "auto" keeps DDP runs eager. The
two-process runs are in tests/distributed/test_packed_launch.py."""

import contextlib
import logging
import types

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from hf_grpo.distributed import ddp_replay
from hf_grpo.run_state import RunDecisions, RunFacts
from hf_grpo.training import graph_inputs
from hf_grpo.training import graphs as training_graphs

from tests.scripts.eager_recorder import EagerRecorder
from tests.training.test_training_compile import batch
from tests.training.test_training_graphs import checkpointed_model, trainer_sizes, windowed_score
from tests.tolerances import backward_terms, reordered

DDP_FACTS = RunFacts(num_processes=2, distributed_type="MULTI_CPU", activation_checkpointing=True, pad_token_id=0)


@pytest.fixture
def process_group(tmp_path):
    """A gloo process group of this process alone, as DDP needs one."""
    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class Perf:
    def add(self, name, value):
        pass


@pytest.mark.parametrize("find_unused", [True, False])
def test_a_replay_through_ddp_has_its_gradients_reduced_once_per_synced_micro_batch(process_group, find_unused):
    model = checkpointed_model()
    ddp = DistributedDataParallel(model, find_unused_parameters=find_unused)
    reduced = []  # what each bucket's all-reduce was given: (parameter, its gradient in the bucket)

    def all_reduce(state, bucket):
        reduced.extend((param, grad.clone()) for param, grad in zip(bucket.parameters(), bucket.gradients()))
        return _done(bucket.buffer())  # one process: the sum is the bucket itself

    ddp.register_comm_hook(None, all_reduce)
    graphs = training_graphs.TrainingGraphs(model, pad_token_id=0, recorder=EagerRecorder(), hand_over=True)
    score = windowed_score(model)
    steps = [[batch(4, prompt=13, completion=9, seed=1), batch(4, prompt=80, completion=9, seed=2)],
             [batch(4, prompt=11, completion=9, seed=3), batch(4, prompt=12, completion=9, seed=4)]]
    trained = sum(p.numel() for p in graphs.params)
    for step in steps:  # gradient accumulation 2: the first micro-batch under no_sync(), as accelerate runs it
        model.zero_grad(set_to_none=True)
        expected = [torch.zeros_like(p) for p in graphs.params]
        for index, (ids, mask, _) in enumerate(step):
            weights = torch.arange(1.0, 5.0).unsqueeze(1)  # rows weighed unequally
            synced = index == len(step) - 1
            reduced.clear()
            with contextlib.nullcontext() if synced else ddp.no_sync():
                result = training_graphs.replay(graphs, Perf(), contextlib.nullcontext, ddp, ids, mask, 9)
                assert result is not None, "the micro-batch scored through DDP was not replayed"
                (result[0] * weights).sum().backward()
            padded = graph_inputs.padded(ids, mask, 9, pad_token_id=0)
            eager = torch.autograd.grad((score(padded.inputs, padded.window)[0] * weights).sum(), graphs.params)
            expected = [total + grad for total, grad in zip(expected, eager)]
            if not synced:
                assert reduced == []  # no_sync(): the gradients stay local until the step's last micro-batch
                continue
            # every trained parameter's gradient all-reduced once, the step's whole accumulation (each element
            # compared: a sum over all of them, in another order than the eager one's, differs by its rounding)
            assert sum(grad.numel() for _, grad in reduced) == trained
            assert sorted(id(param) for param, _ in reduced) == sorted(id(param) for param in graphs.params)
            given = {id(param): grad for param, grad in reduced}
            terms = backward_terms(model.config, sum(ids.numel() for ids, _, _ in step))
            for param, total in zip(graphs.params, expected):
                torch.testing.assert_close(given[id(param)].view_as(total), total, **reordered(total, terms))
        for param, total in zip(graphs.params, expected):
            torch.testing.assert_close(param.grad, total, **reordered(total, terms))
    assert graphs.failure is None and graphs.captures == 2  # prompts of 11-13 tokens share a bucket, 80 another


def test_the_ddp_settings_a_replay_cannot_honour_are_refused_by_name(process_group):
    assert ddp_replay.unsupported_reason(DistributedDataParallel(checkpointed_model())) is None
    assert ddp_replay.unsupported_reason(DistributedDataParallel(checkpointed_model(), find_unused_parameters=True)) \
        is None
    static = DistributedDataParallel(checkpointed_model(), static_graph=True)
    assert ddp_replay.unsupported_reason(static) == (
        "DDP: static_graph (ddp_static_graph=True), whose first backward's delayed all-reduce is not replayed")
    assert ddp_replay.unsupported_reason(checkpointed_model()) == (
        "several processes without DeepSpeed, FSDP or DistributedDataParallel (the model is wrapped in "
        "Qwen2ForCausalLM)")


def choose(model, wrapper, setting):
    settings = types.SimpleNamespace(training_cuda_graphs=setting, padding_free=False, torch_compile=False)
    return training_graphs.choose(settings, model, DDP_FACTS, trainer_sizes(), RunDecisions(), wrapper)


def test_under_ddp_auto_and_on_replay_handing_gradients_over(process_group, monkeypatch, caplog):
    monkeypatch.setattr(training_graphs, "unavailable_reason", lambda *a: None)  # as on a GPU
    model = checkpointed_model()
    wrapper = DistributedDataParallel(model)
    for setting in ("auto", "on"):  # two H200s: the replayed training half 2.8x the eager one's speed
        graphs, reason = choose(model, wrapper, setting)
        assert reason is None and graphs.hand_over  # DDP's hooks reduce .grad: the replay hands gradients over
    assert choose(model, wrapper, "off") == (None, "training_cuda_graphs='off'")
    static = checkpointed_model()
    with caplog.at_level(logging.INFO, logger="hf_grpo"):
        assert training_graphs.start(types.SimpleNamespace(training_cuda_graphs="on", padding_free=False),
                                     static, DDP_FACTS, trainer_sizes(), RunDecisions(eager_rows=None), True,
                                     DistributedDataParallel(static, static_graph=True)) is None
    assert "training_cuda_graphs='on' is not applied: DDP: static_graph" in caplog.text
    assert "training micro-batches: eager launches (DDP: static_graph (ddp_static_graph=True)" in caplog.text


def test_several_processes_wait_for_their_wrapper_and_data_parallel_is_refused(monkeypatch):
    monkeypatch.setattr(training_graphs, "CudaGraphRecorder", EagerRecorder)  # any device, as on a GPU
    facts = dict(device_type="cuda", attention="sdpa", activation_checkpointing=True)
    # several processes without DeepSpeed: decided on the wrapper the Trainer made (DDP, or refused)
    assert training_graphs.unavailable_reason(RunFacts(num_processes=2, **facts), trainer_sizes()) is None
    assert training_graphs.unavailable_reason(RunFacts(n_gpu=2, **facts), trainer_sizes()) == (
        "torch.nn.DataParallel copies the model to each GPU in every forward")


def test_ddp_forward_is_begun_also_where_ddp_moves_its_inputs_to_a_gpu(process_group):
    # On a GPU DDP is given device_ids: its pre-forward moves the inputs there and reads the first moved one. The
    # replay has none to give (its own are static and on the device already).
    ddp = DistributedDataParallel(checkpointed_model())
    ddp.device_ids, ddp.device_type = [0], "cpu"  # as for GPU 0 (a CPU module refuses device_ids when wrapped)
    logps = torch.ones(3, requires_grad=True) * 2
    result = ddp_replay.forward_as_ddp(ddp, lambda: (logps, None))
    assert torch.equal(result[0], logps) and result[1] is None


def test_after_a_failed_capture_the_micro_batch_runs_through_ddp_and_is_reduced(process_group):
    # A capture that fails under "auto" gives None; TRL's eager forward then runs through DDP's, begun again.
    model = checkpointed_model()
    ddp = DistributedDataParallel(model)
    reduced = []
    ddp.register_comm_hook(
        None, lambda state, bucket: reduced.append(bucket.buffer().numel()) or _done(bucket.buffer()))
    assert ddp_replay.forward_as_ddp(ddp, lambda: None) is None
    ids, mask, labels = batch(4, prompt=9, completion=5, seed=0)
    ddp(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True).log_probs.sum().backward()
    assert sum(reduced) == sum(p.numel() for p in model.parameters() if p.requires_grad)


def _done(tensor):
    future = torch.futures.Future()
    future.set_result(tensor)
    return future
