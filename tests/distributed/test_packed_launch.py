"""Packed rows with a prompt's rows grouped (padding_free=True) train as padded rows under DDP, ZeRO-2 and ZeRO-3, and
micro-batches replayed through the training graphs train as eager ones under DDP, ZeRO-1 and ZeRO-2: two processes over
gloo, LoRA, a reference (beta > 0), num_iterations 2, a checkpoint saved in the test."""

import json

import pytest
import torch
from tests.distributed.test_launch import launch

from hf_grpo.recipe_support.tiny import build_char_tokenizer, build_tiny_model

pytestmark = [pytest.mark.slow, pytest.mark.launch]
SCRIPT = "tests/scripts/packed_exactness_train.py"
# fp32 on CPU: packing and grouping only reorder sums (measured differences about 1e-7)
RTOL = 1e-5


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def saved_checkpoint(tmp_path, **config_overrides):
    """A tiny model and its tokenizer saved in a directory, as a hub download lays them out."""
    checkpoint = tmp_path / "checkpoint"
    tokenizer = build_char_tokenizer()
    build_tiny_model(tokenizer, seed=0, **config_overrides).save_pretrained(checkpoint)
    tokenizer.save_pretrained(checkpoint)
    return checkpoint


def chosen(run_dir, rank: int) -> dict:
    """What a run of the script chose on ``rank`` (its chosen_rank<N>.json)."""
    return json.loads((run_dir / f"chosen_rank{rank}.json").read_text())


@pytest.mark.parametrize("config", ["multi_gpu", "zero2", "zero3"])
def test_packed_and_grouped_micro_batches_train_as_padded_ones(tmp_path, config):
    checkpoint = saved_checkpoint(tmp_path)
    launch(config, SCRIPT, tmp_path, checkpoint, "padded", "packed")  # both variants in one launch
    padded, packed = tmp_path / "padded", tmp_path / "packed"

    for rank in (0, 1):
        chose_padded = chosen(padded, rank)
        chose_packed = chosen(packed, rank)
        assert chose_padded["packed"] == 0 and "scored padded" in chose_padded["grouping"]
        assert chose_packed["eager_rows"] == "rows packed (padding_free=True)"
        assert chose_packed["grouping"] == "on"
        assert chose_packed["shared"] > 0, "some micro-batches ran a prompt once for its rows"
    assert_same_training(padded, packed)


@pytest.mark.parametrize("config", ["zero1", "zero2"])
def test_micro_batches_replayed_under_deepspeed_train_as_eager_ones(tmp_path, config):
    # The graphs hand their gradients to autograd, whose accumulation runs DeepSpeed's reduction hooks (on a CPU
    # the capture is stood in by an eager "replay": everything around it runs as on a GPU).
    checkpoint = saved_checkpoint(tmp_path)
    launch(config, SCRIPT, tmp_path, checkpoint, "padded", "graphs")
    for rank in (0, 1):
        chose = chosen(tmp_path / "graphs", rank)
        assert chose["graphs_hand_over"] is True and chose["graphs_failure"] is None
        assert chose["graph_captures"] > 0
        assert chose["timer_synchronized"] is False  # the engine built from the config that deepspeed_timers set
    assert_same_training(tmp_path / "padded", tmp_path / "graphs")


def test_micro_batches_replayed_under_ddp_train_as_eager_ones(tmp_path):
    # DDP's reducer acts on its hooks only after its forward prepared it: the replay runs amid DDP's pre- and
    # post-forward (hf_grpo.distributed.ddp_replay), and its node hands the gradients to autograd, whose
    # accumulation runs the hooks. Gradient accumulation 2: every other micro-batch runs under no_sync().
    checkpoint = saved_checkpoint(tmp_path)
    launch("multi_gpu", SCRIPT, tmp_path, checkpoint, "padded", "graphs", "graphs_all_used")
    for variant, find_unused in (("padded", True), ("graphs", True), ("graphs_all_used", False)):
        for rank in (0, 1):
            chose = chosen(tmp_path / variant, rank)
            assert chose["ddp_find_unused"] is find_unused  # the Trainer's default for a LoRA model: True
            if variant != "padded":
                assert chose["graphs_hand_over"] is True and chose["graphs_failure"] is None
                assert chose["graph_captures"] > 0
    assert_same_training(tmp_path / "padded", tmp_path / "graphs")
    assert_same_training(tmp_path / "padded", tmp_path / "graphs_all_used")


def test_compiled_layers_with_packed_rows_under_zero3_train_as_eager_padded_ones(tmp_path):
    # Each decoder layer is a ZeRO-3 leaf module: its one gathering hook runs around the compiled forward, and the
    # compiled backward (activation checkpointing inside the graph) recomputes from the parameters DeepSpeed
    # gathers again before the layer's backward.
    checkpoint = saved_checkpoint(tmp_path)
    result = launch("zero3", SCRIPT, tmp_path, checkpoint, "checkpointed", "compiled")
    assert "training forward: decoder layers compiled" in result.stderr
    for rank in (0, 1):
        chose = chosen(tmp_path / "compiled", rank)
        assert chose["compiled_graphs"] > 0 and chose["compile_failure"] is None
        assert chose["eager_packed"] and chose["shared"] > 0  # packed rows, a prompt run once for its rows
    assert_same_training(tmp_path / "checkpointed", tmp_path / "compiled")


def test_zero3_with_one_process_runs_without_its_hooks_and_trains_as_with_them(tmp_path):
    # One process: a partition holds the whole parameter, so DeepSpeed's gathering hooks are removed and every
    # parameter stays gathered (distributed.zero3_one_process). The run trains as one whose parameters DeepSpeed's
    # hooks release between uses; compiled layers with packed rows, and checkpointed micro-batches replayed (graphs,
    # stood in on the CPU), as eager padded ones. Checkpointing is non-reentrant again (TRL makes it reentrant for
    # LoRA under ZeRO-3, where a replay's backward would reach no parameter).
    # MLP weights of 64 x 1600 elements: above DeepSpeed's own persistence threshold (1e5), so released between uses
    checkpoint = saved_checkpoint(tmp_path, intermediate_size=1600)
    result = launch("zero3", SCRIPT, tmp_path, checkpoint, "checkpointed_released", "checkpointed", "compiled",
                    "graphs_checkpointed", processes=1)
    assert "ZeRO-3 with one process: DeepSpeed's" in result.stderr and "gathering hooks removed" in result.stderr
    assert "activation checkpointing non-reentrant" in result.stderr
    for variant in ("checkpointed", "compiled", "graphs_checkpointed"):
        chose = chosen(tmp_path / variant, 0)
        assert chose["zero3_hooks_removed"] is True
        persistent, total = chose["zero3_persistent"]
        assert persistent == total > 0
    released = chosen(tmp_path / "checkpointed_released", 0)
    assert released["zero3_hooks_removed"] is False
    assert released["zero3_persistent"][0] < released["zero3_persistent"][1]  # DeepSpeed's threshold: small ones
    assert chosen(tmp_path / "compiled", 0)["compiled_graphs"] > 0
    graphs = chosen(tmp_path / "graphs_checkpointed", 0)
    assert graphs["graphs_hand_over"] is True and graphs["graphs_failure"] is None and graphs["graph_captures"] > 0
    assert_same_training(tmp_path / "checkpointed_released", tmp_path / "checkpointed")
    assert_same_training(tmp_path / "checkpointed", tmp_path / "compiled")
    assert_same_training(tmp_path / "checkpointed_released", tmp_path / "graphs_checkpointed")


def launch_on_gpu(monkeypatch, tmp_path, config, *variants, processes=1, **config_overrides):
    """The script's ``variants`` in one launch on the GPU (fp32), from a checkpoint saved in the test."""
    monkeypatch.setenv("EXACTNESS_ON_GPU", "1")
    launch(config, SCRIPT, tmp_path, saved_checkpoint(tmp_path, **config_overrides), *variants, processes=processes)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_micro_batches_replayed_from_cuda_graphs_under_zero2_on_one_gpu_train_as_eager_ones(tmp_path, monkeypatch):
    # Real captures and replays (fp32, rows padded: packed rows replay in half precision only) under DeepSpeed.
    launch_on_gpu(monkeypatch, tmp_path, "zero2", "padded", "graphs")
    chose = chosen(tmp_path / "graphs", 0)
    assert chose["graphs_hand_over"] is True and chose["graphs_failure"] is None and chose["graph_captures"] > 0
    assert_same_training(tmp_path / "padded", tmp_path / "graphs", rtol=1e-4)  # GPU kernels sum in other orders


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_micro_batches_replayed_from_cuda_graphs_under_ddp_on_two_gpus_train_as_eager_ones(tmp_path, monkeypatch):
    # Real captures and replays under DDP over NCCL, one GPU a rank: the reducer's all-reduce runs after each synced
    # replay, with and without find_unused_parameters (fp32, rows padded).
    launch_on_gpu(monkeypatch, tmp_path, "multi_gpu", "padded", "graphs", "graphs_all_used", processes=2)
    for variant in ("graphs", "graphs_all_used"):
        for rank in (0, 1):
            chose = chosen(tmp_path / variant, rank)
            assert chose["graphs_hand_over"] is True and chose["graphs_failure"] is None
            assert chose["graph_captures"] > 0
        # each micro-batch in one shape on both ranks (rank_shapes): they capture the same graphs, none waits
        assert chosen(tmp_path / variant, 0)["graph_captures"] == chosen(tmp_path / variant, 1)["graph_captures"]
        assert_same_training(tmp_path / "padded", tmp_path / variant, rtol=1e-4)  # GPU kernels sum in other orders


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_packed_and_grouped_micro_batches_under_zero3_on_one_gpu_train_as_padded_ones(tmp_path, monkeypatch):
    # The eager path ZeRO-3 takes on a GPU: packed rows through the CUDA attention kernels, each layer's parameters
    # gathered by its hook, the rollout read from the partitions in place (one process; fp32).
    launch_on_gpu(monkeypatch, tmp_path, "zero3", "padded", "packed")
    chose = chosen(tmp_path / "packed", 0)
    assert chose["eager_packed"] and chose["shared"] > 0
    assert_same_training(tmp_path / "padded", tmp_path / "packed", rtol=1e-4)  # GPU kernels sum in other orders


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_zero3_with_one_process_on_a_gpu_runs_without_its_hooks_and_trains_as_with_them(tmp_path, monkeypatch):
    # The CPU test's run on the GPU (fp32): DeepSpeed's fetches and releases on their own streams where its hooks
    # are kept; without them, real CUDA-graph replays. Compiled layers are asked for and, under ZeRO-3 on a GPU, not
    # applied yet (training.compiled_layers.ZERO3_CUDA_REASON): the run trains as the eager one.
    variants = ("checkpointed", "compiled", "graphs", "graphs_checkpointed")
    launch_on_gpu(monkeypatch, tmp_path, "zero3", "checkpointed_released", *variants, intermediate_size=1600)
    assert chosen(tmp_path / "checkpointed_released", 0)["zero3_hooks_removed"] is False
    for variant in variants:
        assert chosen(tmp_path / variant, 0)["zero3_hooks_removed"] is True
    assert chosen(tmp_path / "compiled", 0)["compiled_graphs"] is None
    for variant in ("graphs", "graphs_checkpointed"):
        graphs = chosen(tmp_path / variant, 0)
        assert graphs["graphs_hand_over"] is True and graphs["graphs_failure"] is None and graphs["graph_captures"] > 0
    for variant in variants:  # GPU kernels sum in other orders
        assert_same_training(tmp_path / "checkpointed_released", tmp_path / variant, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_compiled_layers_asked_for_under_zero3_on_two_gpus_are_refused_and_the_run_trains_as_eager(tmp_path,
                                                                                                   monkeypatch):
    # Compiled by inductor under ZeRO-3's hooks on an H200, the layers trained differently from eager ones (fp32: the
    # first step's grad norm 0.157 against 0.190; without DeepSpeed, and on the CPU, they train alike): refused
    # where the hooks stay, with several processes.
    launch_on_gpu(monkeypatch, tmp_path, "zero3", "checkpointed", "compiled", processes=2)
    for rank in (0, 1):
        assert chosen(tmp_path / "compiled", rank)["compiled_graphs"] is None  # compile_training="on", not applied
    assert_same_training(tmp_path / "checkpointed", tmp_path / "compiled", rtol=1e-4)  # GPU kernels sum in other orders


def assert_same_training(padded, other, rtol=RTOL):
    """The same logged losses and grad norms, and the same update of the trained weights, to ``rtol``."""
    want, got = (json.loads((run / "logged.json").read_text()) for run in (padded, other))
    assert [r["step"] for r in got] == [r["step"] for r in want] == [1, 2, 3]
    for key in ("loss", "grad_norm"):
        expected, actual = torch.tensor([r[key] for r in want]), torch.tensor([r[key] for r in got])
        assert expected.abs().sum() > 0
        said = f"{key}: {actual.tolist()} against {expected.tolist()}"  # the figures, where a GPU run fails
        torch.testing.assert_close(actual, expected, rtol=rtol, atol=1e-7, msg=lambda why, said=said: f"{said}; {why}")

    want, got = (torch.load(run / "params.pt", map_location="cpu") for run in (padded, other))
    assert got["trained"].keys() == want["trained"].keys() and any("lora_" in name for name in want["trained"])
    flat = lambda state: torch.cat([state[name].flatten() for name in sorted(state)])  # noqa: E731
    assert torch.equal(flat(got["initial"]), flat(want["initial"]))  # the same adapters to start from
    update = lambda run: flat(run["trained"]) - flat(run["initial"])  # noqa: E731
    assert update(want).norm() > 0
    assert relative(update(got), update(want)) < rtol
