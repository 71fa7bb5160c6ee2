"""Training micro-batches replayed from CUDA graphs (hf_grpo.training.graphs): the static-shape head and the bucket
padding give the eager log-probs and gradients; the captured gradient buffers keep what was accumulated; a whole run
through the replay path updates as one without (on a CPU with the capture stood in by an eager replay; on a GPU)."""

import dataclasses
import json
import types

import pytest
import torch

from hf_grpo.logprob_head import install_chunked_lm_head
from hf_grpo.recipe_support.tiny import build_char_tokenizer, build_tiny_model
from hf_grpo.run_state import RunFacts, RunSizes
from hf_grpo.training import eager_packing, graph_buckets, graph_inputs
from hf_grpo.training import graphs as training_graphs

from tests.project_files import load_bench
from tests.scripts.eager_recorder import EagerRecorder
from hf_grpo.training.cuda_graph_recorder import first_of_each_shape
from tests.training.test_training_compile import batch
from tests.tolerances import backward_terms, reordered


@pytest.mark.parametrize("width, expected", [(1, 64), (64, 64), (65, 128), (300, 320), (512, 512), (513, 576),
                                             (1000, 1024), (1025, 1152), (4000, 4096)])
def test_bucket_pads_less_than_an_eighth_above_512_and_to_64_below(width, expected):
    assert graph_inputs.bucket(width) == expected
    assert expected - width < max(64, width / 8)


@pytest.mark.parametrize("width, expected", [(1, 64), (300, 320), (513, 640), (1025, 1280), (2500, 2560),
                                             (4097, 5120)])
def test_a_packed_length_takes_four_buckets_an_octave(width, expected):
    assert graph_inputs.bucket(width, graph_inputs.PACKED_BUCKETS_PER_OCTAVE) == expected
    assert expected - width < max(64, width / 4)


def test_bucket_names_a_bad_width():
    with pytest.raises(ValueError, match="at least 1, got 0"):
        graph_inputs.bucket(0)


def test_bad_setting_is_named(make_config):
    with pytest.raises(ValueError, match=r"training_cuda_graphs must be one of \['auto', 'on', 'off'\], got 'yes'"):
        make_config(training_cuda_graphs="yes")


def checkpointed_model():
    model = build_tiny_model(build_char_tokenizer(), attn_implementation="sdpa")
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    install_chunked_lm_head(model, temperature=0.7, chunk_rows=5, return_entropy=True)
    return model


def logps_and_grads(model, ids, mask, labels, **kwargs):
    model.zero_grad()
    out = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True, **kwargs)
    # a loss that weighs rows unequally, so a row's gradient given to another shows
    weights = torch.arange(1.0, ids.shape[0] + 1).unsqueeze(1)
    (out.log_probs * weights).sum().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    return out.log_probs.detach(), out.entropy.detach(), grads


def test_the_static_window_head_scores_as_the_masked_head():
    # The graph's head scores every position of the completion window; the eager head only the labelled ones.
    model = checkpointed_model()
    ids, mask, labels = batch(4, prompt=9, completion=7, seed=3)
    expected = logps_and_grads(model, ids, mask, labels)
    got = logps_and_grads(model, ids, mask, labels, scored_window=7)
    torch.testing.assert_close(got[0], expected[0], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(got[1], expected[1], rtol=1e-6, atol=1e-7)
    assert (got[0][labels[:, 1:] == -100] == 0).all()
    terms = backward_terms(model.config, ids.numel())
    for name, grad in expected[2].items():  # summed in another order: fp32 rounding
        torch.testing.assert_close(got[2][name], grad, **reordered(grad, terms), msg=name)


def test_the_static_window_heads_chunks_stay_small_whatever_tensor_batch_size_asks(monkeypatch):
    # A graph's pool keeps the head's chunk between steps: at most STATIC_WINDOW_CHUNK_ROWS rows, fewer if asked.
    from hf_grpo import logprob_head

    asked = []
    chunked = logprob_head.chunked_logprobs
    monkeypatch.setattr(logprob_head, "chunked_logprobs",
                        lambda *a, chunk_rows, **kw: asked.append(chunk_rows) or chunked(*a, chunk_rows=chunk_rows, **kw))
    ids, mask, labels = batch(4, prompt=9, completion=7, seed=3)
    # None (no chunking) is every scored position: 4 rows x a 7-token window
    for rows, expected in [(1024, logprob_head.STATIC_WINDOW_CHUNK_ROWS), (None, 28), (5, 5)]:
        model = build_tiny_model(build_char_tokenizer())
        install_chunked_lm_head(model, temperature=1.0, chunk_rows=rows, return_entropy=False)
        model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True, scored_window=7)
        assert asked.pop() == expected, rows


def test_a_micro_batch_padded_to_its_bucket_keeps_every_log_prob_and_gradient():
    # Extra left padding would move every real token's position; the bucket's position ids keep them where they were.
    model = checkpointed_model()
    ids, mask, labels = batch(3, prompt=11, completion=6, seed=1)
    expected = logps_and_grads(model, ids, mask, labels)
    padded_ids, padded_mask, positions = graph_inputs.pad_to_bucket(ids, mask, completion_width=6, pad_token_id=0)
    assert padded_ids.shape == (3, 128) and positions.shape == (3, 128)
    padded_labels = padded_ids.masked_fill(padded_mask == 0, -100)
    padded_labels[:, :-64] = -100
    got = logps_and_grads(model, padded_ids, padded_mask, padded_labels, position_ids=positions, scored_window=64)
    # the completion's label columns are 64..69 of the padded batch: log-prob columns 63..68
    torch.testing.assert_close(got[0][:, 63:69], expected[0][:, -6:], rtol=1e-5, atol=1e-6)
    assert (got[0][:, :63] == 0).all() and (got[0][:, 69:] == 0).all()
    terms = backward_terms(model.config, ids.numel())
    for name, grad in expected[2].items():  # summed in another order over the padded batch
        torch.testing.assert_close(got[2][name], grad, **reordered(grad, terms), msg=name)


def test_a_packed_micro_batch_keeps_every_log_prob_and_gradient():
    # padding_free: the rows' real tokens in one sequence of a bucketed length; only the scored completion tokens
    # reach the head, gathered from their packed places; spread puts their log-probs back in TRL's layout.
    model = checkpointed_model()
    ids, mask, labels = batch(5, prompt=11, completion=7, seed=2)
    expected = logps_and_grads(model, ids, mask, labels)
    key, inputs, window, spread = graph_inputs.packed(model, ids, mask, completion_width=7, pad_token_id=0)
    tokens, scored = int(mask.sum()), int((labels != -100).sum())
    assert key == ("packed", graph_inputs.bucket(tokens + 1, per_octave=4), 0) and window == 64 and scored < 64
    assert inputs["input_ids"].shape == (1, key[1]) and inputs["window_index"].shape == (1, 64)
    assert inputs["cu_seq_lens"].tolist() == inputs["cu_seq_lens_host"].tolist()  # 5 rows, then the padding row
    assert inputs["cu_seq_lens"].tolist()[-2:] == [tokens, key[1]]
    assert (inputs["labels"][0, scored:] == -100).all() and (inputs["labels"][0, :scored] >= 0).all()
    model.zero_grad()
    out = model(**graph_inputs.model_kwargs(inputs, window))
    assert out.log_probs.shape == (1, 64) and (out.log_probs[0, scored:] == 0).all()
    logps = spread(out.log_probs)
    weights = torch.arange(1.0, 6.0).unsqueeze(1)
    (logps * weights).sum().backward()
    torch.testing.assert_close(logps, expected[0][:, -7:], rtol=1e-5, atol=1e-6)  # zeros where TRL's are
    terms = backward_terms(model.config, ids.numel())
    for name, param in model.named_parameters():  # (summed in another order than the padded batch's)
        torch.testing.assert_close(param.grad, expected[2][name], **reordered(expected[2][name], terms), msg=name)


def test_a_packed_shape_does_not_follow_the_rollouts_longest_completion():
    # The completion width is the rollout's longest completion, new at every rollout; packed, the graphs' shape
    # is set by the micro-batch's own tokens, so a micro-batch of another rollout with the same tokens replays.
    model = checkpointed_model()
    ids, mask, _ = batch(4, prompt=11, completion=7, seed=3)
    wider_ids = torch.nn.functional.pad(ids, (0, 70), value=0)
    wider_mask = torch.nn.functional.pad(mask, (0, 70), value=0)
    narrow = graph_inputs.packed(model, ids, mask, 7, pad_token_id=0)
    wide = graph_inputs.packed(model, wider_ids, wider_mask, 77, pad_token_id=0)
    assert (narrow.key, narrow.window) == (wide.key, wide.window)
    for name, value in narrow.inputs.items():
        assert torch.equal(value, wide.inputs[name]), name
    values = torch.arange(1.0, 65.0).unsqueeze(0)
    assert torch.equal(wide.spread(values)[:, :7], narrow.spread(values))
    assert (wide.spread(values)[:, 7:] == 0).all()
    padded = graph_inputs.padded(ids, mask, 7, pad_token_id=0), graph_inputs.padded(wider_ids, wider_mask, 77, 0)
    assert padded[0].window != padded[1].window  # padded, the window is the completion width's bucket


def test_over_real_rollout_lengths_packed_micro_batches_meet_fewer_shapes_and_score_fewer_positions(capsys):
    # bench/graph_shapes.py runs the trainer's own static_inputs over six rollouts of the 1.5B benchmark's lengths
    # (prompts of 64-1024 tokens): against the layout before (eight length buckets an octave, the rollout's
    # completion window scored whole), fewer shapes to capture, and a head that scores fewer positions; fewer
    # still where new shapes replay a captured larger one first (shape_reuse). Rows of one prompt share it, so
    # the layers run over fewer tokens than the rows hold (sharing adds a dimension to the shapes, which reuse takes).
    load_bench("graph_shapes").main(["--shapes", "1.5b", "--steps", "6"])
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert sum(row["current"]["captures_by_step"]) == row["current"]["shapes"]
    assert row["current"]["shapes"] < min(row["no_reuse"]["shapes"], row["before"]["shapes"])
    assert row["layer_tokens_mean"]["no_reuse"] < row["layer_tokens_mean"]["real_tokens"]
    assert row["reused"] > 0 and row["work_mean"]["current"] > row["work_mean"]["no_reuse"]  # what reuse costs
    head = row["head_positions_mean"]
    assert head["scored_tokens"] <= head["current"] < head["before"]


@pytest.mark.parametrize(("scored", "width"), [(0, 64), (1, 64), (64, 64), (65, 128), (700, 1024), (1024, 1024)])
def test_the_scored_width_is_a_power_of_two_of_at_least_64(scored, width):
    assert graph_inputs.scored_width(scored) == width


def test_rows_that_cannot_be_packed_go_padded():
    # A row whose tokens are not one run (a hole in its mask) cannot be packed; nor a row beyond a sliding window.
    ids, mask, _ = batch(3, prompt=11, completion=7, seed=2)
    longest = int(mask.sum(1).max())
    windowed = build_tiny_model(build_char_tokenizer(), use_sliding_window=True, sliding_window=longest - 1,
                                layer_types=["sliding_attention", "full_attention"])
    assert graph_inputs.packed(windowed, ids, mask, 7, pad_token_id=0) is None
    windowed.config.sliding_window = longest
    assert graph_inputs.packed(windowed, ids, mask, 7, pad_token_id=0) is not None
    model = checkpointed_model()
    mask[0, -7:] = torch.tensor([1, 0, 1, 0, 0, 0, 0])
    assert graph_inputs.packed(model, ids, mask, 7, pad_token_id=0) is None
    graphs = training_graphs.TrainingGraphs(model, pad_token_id=0, packed=True)
    assert graphs.static_inputs(ids, mask, 7).key[0] == "padded"


def test_the_captured_gradient_buffers_keep_what_was_accumulated():
    # The Trainer sets gradients to None after each optimizer step, the back-off zeroes them, eager micro-batches
    # may have accumulated into fresh tensors: before a replay the buffers become the gradients again, keeping sums.
    model = torch.nn.Linear(3, 2)
    graphs = training_graphs.TrainingGraphs(model, pad_token_id=0)
    graphs.grad_buffers = [torch.full_like(p, 9.0) for p in graphs.params]
    weight, bias = graphs.params
    weight.grad, bias.grad = torch.ones_like(weight), None
    graphs.adopt_gradients()
    assert weight.grad is graphs.grad_buffers[0] and bias.grad is graphs.grad_buffers[1]
    assert (weight.grad == 1).all() and (bias.grad == 0).all()
    weight.grad.add_(2.0)
    graphs.adopt_gradients()  # already adopted: left as it is
    assert weight.grad is graphs.grad_buffers[0] and (weight.grad == 3).all()


def test_handed_over_gradients_reach_the_accumulation_hooks_once_per_micro_batch_as_eager_ones():
    # Under DeepSpeed ZeRO-1/2 the gradients are DeepSpeed's: hooks on each parameter's accumulation take .grad
    # into their buckets and set it to None. The replay hands its gradients to autograd, so those hooks run once
    # per micro-batch with the eager gradient; the warm-up and the captures never run them.
    model = checkpointed_model()
    graphs = training_graphs.TrainingGraphs(model, pad_token_id=0, recorder=EagerRecorder(), hand_over=True)
    taken = {id(p): torch.zeros_like(p) for p in graphs.params}  # what the hooks took, as DeepSpeed's buckets
    calls = []

    def take(param):
        calls.append(id(param))
        assert all(param.grad is not buffer for buffer in graphs.grad_buffers)  # a copy, not the graph's buffer
        taken[id(param)] += param.grad
        param.grad = None

    for param in graphs.params:
        param.register_post_accumulate_grad_hook(take)
    score = windowed_score(model)
    micro_batches = [batch(4, prompt=13, completion=9, seed=1), batch(4, prompt=80, completion=9, seed=2),
                     batch(4, prompt=11, completion=9, seed=3)]  # the third replays the first's bucket
    expected = [torch.zeros_like(p) for p in graphs.params]
    for ids, mask, _ in micro_batches:
        weights = torch.arange(1.0, 5.0).unsqueeze(1)  # rows weighed unequally
        logps, _ = graphs.logps(score, ids, mask, 9, compute_entropy=False)
        (logps * weights).sum().backward()
        padded = graph_inputs.padded(ids, mask, 9, pad_token_id=0)
        eager = torch.autograd.grad((score(padded.inputs, padded.window)[0] * weights).sum(), graphs.params)
        expected = [total + grad for total, grad in zip(expected, eager)]
    assert graphs.failure is None and graphs.captures == 2
    assert len(calls) == 3 * len(graphs.params)  # once per parameter and micro-batch, never in a capture
    assert all(p.grad is None for p in graphs.params)  # nothing written to .grad behind the hooks' back
    terms = backward_terms(model.config, sum(ids.numel() for ids, _, _ in micro_batches))
    for param, total in zip(graphs.params, expected):
        torch.testing.assert_close(taken[id(param)], total, **reordered(total, terms))


def tiny_cpu_trainer(tmp_path, **config):
    """A GRPO trainer on the CPU, built as a user builds one, for the choice made at train begin."""
    import hf_grpo
    from datasets import Dataset

    tokenizer = build_char_tokenizer()
    config = hf_grpo.GRPOConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True, bf16=False, max_steps=1,
                                per_device_train_batch_size=2, num_generations=2, max_completion_length=4,
                                generation_backend="hf", **config)
    return hf_grpo.GRPOTrainer(model=build_tiny_model(tokenizer), args=config, processing_class=tokenizer,
                               reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                               train_dataset=Dataset.from_dict({"prompt": ["ab>", "c>"]}))


def choose(trainer, **settings):
    """``training_graphs.choose`` for ``trainer``'s run, with ``settings`` over its config (not written)."""
    return training_graphs.choose(types.SimpleNamespace(**{**vars(trainer.args), **settings}), trainer.model,
                                  trainer.facts, trainer.sizes, trainer.decisions)


def start(trainer, **settings):
    return training_graphs.start(types.SimpleNamespace(**{**vars(trainer.args), **settings}), trainer.model,
                                 trainer.facts, trainer.sizes, trainer.decisions, True)


def trainer_sizes(**sizes):
    values = dict(per_device_train_batch_size=2, gradient_accumulation_steps=1, steps_per_generation=1,
                  per_device_generation_batch_size=None, tensor_batch_size=None, max_tokens_per_micro_batch=None)
    return RunSizes(**{**values, **sizes})


def test_first_of_each_shape_names_one_parameter_a_shape_and_skips_large_tables():
    params = [torch.zeros(300, 8), torch.zeros(4, 8), torch.zeros(4, 8), torch.zeros(8, 4), torch.zeros(4, 8,
              dtype=torch.float64), torch.zeros(8)]
    assert first_of_each_shape(params, most=1000) == [1, 3, 4, 5]  # 300 x 8 is past most; one (4, 8) a dtype
    assert first_of_each_shape(params[:1], most=10) == [0]  # none small enough: the last, as before


def test_a_second_attempt_warms_up_a_gradient_of_every_shape_before_its_capture(monkeypatch):
    # A weight-gradient product first run inside a capture would load its kernel there. Before a capture's second
    # attempt (and a compiled layer's later bucket), the eager pass asks for one gradient of each parameter shape:
    # every such product's shape runs once at the bucket's size, without a second set of gradients.
    model = checkpointed_model()
    graphs = training_graphs.TrainingGraphs(model, pad_token_id=0, recorder=OnceFailingRecorder(fail_at=3),
                                            hand_over=True)
    asked = []
    grad = torch.autograd.grad

    def spy(outputs, inputs, *args, **kwargs):
        asked.append([tuple(t.shape) for t in inputs])
        return grad(outputs, inputs, *args, **kwargs)

    monkeypatch.setattr(torch.autograd, "grad", spy)
    score = windowed_score(model)
    for ids, mask, _ in [batch(4, prompt=13, completion=9, seed=1), batch(4, prompt=80, completion=9, seed=2)]:
        graphs.logps(score, ids, mask, 9, compute_entropy=False)[0].sum().backward()
    assert graphs.failure is None and graphs.recorder.recovered == 1
    shapes = {tuple(p.shape) for p in graphs.params}
    partial = [call for call in asked if len(call) < len(graphs.params)]
    assert len(partial) == 1 and sorted(partial[0]) == sorted(shapes)  # the second attempt's pass: every shape once


def test_a_cpu_run_says_why_no_graphs(tmp_path, caplog):
    trainer = tiny_cpu_trainer(tmp_path, training_cuda_graphs="auto")
    graphs, reason = choose(trainer)
    assert graphs is None and reason == "CUDA graphs need a CUDA device (device cpu)"
    assert "not applied" not in caplog.text  # "auto" falls back quietly
    assert choose(trainer, training_cuda_graphs="on")[0] is None
    assert "training_cuda_graphs='on' is not applied: CUDA graphs need a CUDA device (device cpu)" in caplog.text
    assert choose(trainer, training_cuda_graphs="off") == (None, "training_cuda_graphs='off'")


def test_auto_leaves_runs_without_activation_checkpointing_eager(tmp_path, monkeypatch, caplog):
    # Their graphs' pool would hold a whole micro-batch's activations through the rollout; "on" replays anyway.
    monkeypatch.setattr(training_graphs, "unavailable_reason", lambda *a: None)  # as on one GPU
    trainer = tiny_cpu_trainer(tmp_path, activation_checkpointing=False)
    assert trainer.args.training_cuda_graphs == "auto" and not trainer.facts.activation_checkpointing
    graphs, reason = choose(trainer)
    assert graphs is None and reason.startswith("activation checkpointing is off")
    with caplog.at_level("INFO", logger="hf_grpo"):
        assert start(trainer) is None
    assert "training micro-batches: eager launches (activation checkpointing is off" in caplog.text
    assert isinstance(choose(trainer, training_cuda_graphs="on")[0], training_graphs.TrainingGraphs)
    checkpointed = tiny_cpu_trainer(tmp_path, activation_checkpointing=True)
    assert checkpointed.facts.activation_checkpointing
    graphs = choose(checkpointed)[0]
    assert isinstance(graphs, training_graphs.TrainingGraphs)
    assert graphs.warmup_passes == training_graphs.WARMUP_PASSES["eager"]
    # the Trainer's own compile may compile again for a new shape
    assert choose(checkpointed, torch_compile=True)[0].warmup_passes == training_graphs.WARMUP_PASSES["compiled"]


def test_auto_leaves_micro_batches_bound_by_the_gpu_eager_and_on_replays_them(tmp_path, monkeypatch, caplog):
    # A 7B layer (233M parameters) over 8 rows of 1024 + 2048 tokens: 1.1e13 FLOPs, GPU-bound; a replay there saves
    # no host time while each new packed shape costs a capture (measured: docs/performance.md). 1.5B at 1024 + 512
    # (47M a layer, 1.2e12) is host-bound and keeps its graphs, as a 3B model (77M) at those lengths does.
    monkeypatch.setattr(training_graphs, "unavailable_reason", lambda *a: None)  # as on one GPU
    trainer = tiny_cpu_trainer(tmp_path, activation_checkpointing=True)
    weigh = lambda params, tokens: eager_packing.choose(layer_parameters=params, micro_batch_tokens=tokens,  # noqa
                                                        device_type="cuda")
    trainer.decisions.eager_rows = weigh(233_000_000, 8 * (1024 + 2048))
    graphs, reason = choose(trainer)
    assert graphs is None and reason.startswith("bound by the GPU (1.1e+13 FLOPs a layer a micro-batch >= 5.0e+12)")
    with caplog.at_level("INFO", logger="hf_grpo"):
        assert start(trainer) is None
    assert "training micro-batches: eager launches (bound by the GPU" in caplog.text
    assert "rows packed (padding_free=None: bound by the GPU" in caplog.text  # the eager rows' own layout, said too
    assert isinstance(choose(trainer, training_cuda_graphs="on")[0], training_graphs.TrainingGraphs)
    for params in (47_000_000, 77_000_000):  # 1.5B and 3B at 1024 + 512: the host is the bound
        trainer.decisions.eager_rows = weigh(params, 8 * (1024 + 512))
        assert isinstance(choose(trainer)[0], training_graphs.TrainingGraphs)
    trainer.decisions.eager_rows = eager_packing.Choice(True, "padding_free=True")  # not weighed: replayed
    assert isinstance(choose(trainer)[0], training_graphs.TrainingGraphs)


def test_auto_replays_under_zero_1_and_2_handing_gradients_over_and_leaves_zero3_and_ddp_eager(tmp_path, monkeypatch):
    # ZeRO-1/2: DeepSpeed's hooks own .grad, so the replay hands its gradients to autograd (timed on a GPU:
    # docs/performance.md); ZeRO-3 gathers parameters in hooks a graph cannot hold.
    monkeypatch.setattr(training_graphs.CudaGraphRecorder, "device_reason", staticmethod(lambda device: None))
    trainer = tiny_cpu_trainer(tmp_path, activation_checkpointing=True)
    assert choose(trainer)[0].hand_over is False  # one process: the backward graph writes .grad itself
    trainer.facts = dataclasses.replace(trainer.facts, deepspeed=True, num_processes=2)
    graphs, reason = choose(trainer)
    assert reason is None and graphs.hand_over is True
    trainer.facts = dataclasses.replace(trainer.facts, zero3=True)
    assert choose(trainer) == (None, "ZeRO-3 gathers each layer's parameters in hooks a graph cannot hold")
    trainer.facts = dataclasses.replace(trainer.facts, deepspeed=False, zero3=False)
    graphs, reason = choose(trainer, training_cuda_graphs="on")
    assert graphs is None and reason.startswith("several processes without DeepSpeed")


def test_graphs_replay_rows_packed_unless_padding_free_is_off_or_the_attention_cannot(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(training_graphs, "unavailable_reason", lambda *a: None)  # as on one GPU
    trainer = tiny_cpu_trainer(tmp_path)
    assert trainer.args.padding_free is None  # the default: packed where the graphs replay
    unpacked = training_graphs.unpacked_reason
    assert unpacked(None, trainer.model, trainer.facts).startswith("packed rows replay only through variable-length")
    trainer.facts = dataclasses.replace(trainer.facts, half=True)  # as with bf16=True
    assert unpacked(None, trainer.model, trainer.facts) is None
    with caplog.at_level("INFO", logger="hf_grpo"):
        assert start(trainer).packed
    assert "training micro-batches: replayed from CUDA graphs, rows packed" in caplog.text
    with caplog.at_level("INFO", logger="hf_grpo"):
        assert not start(trainer, padding_free=False).packed
    assert "replayed from CUDA graphs, rows padded (padding_free=False)" in caplog.text
    trainer.model.config._attn_implementation = "eager"  # each model's own function: may not be plain softmax
    assert "is not one of" in unpacked(None, trainer.model, trainer.facts)


class FailingRecorder(EagerRecorder):
    """Captures the first ``succeed`` functions, then fails as a capture that waits on the host does."""

    def __init__(self, succeed: int):
        self.succeed, self.recovered = succeed, 0

    def record(self, fn, pool, model=None):
        if self.succeed == 0:
            raise RuntimeError("operation not permitted when stream is capturing")
        self.succeed -= 1
        return super().record(fn, pool, model)

    def recover(self):
        self.recovered += 1


def test_a_failed_capture_mid_step_keeps_the_steps_gradients_and_lets_go_of_the_graphs():
    # A later bucket's capture fails after a replayed micro-batch: "auto" goes on eagerly, the gradients the step
    # has accumulated stay the parameters' and grow with the eager micro-batches, and the graphs hold nothing.
    model = checkpointed_model()
    score = windowed_score(model)
    graphs = training_graphs.TrainingGraphs(model, pad_token_id=0, recorder=FailingRecorder(succeed=2))
    first, second = batch(4, prompt=13, completion=9, seed=1), batch(4, prompt=80, completion=9, seed=2)
    (graphs.logps(score, first[0], first[1], 9, compute_entropy=False)[0].sum()).backward()
    accumulated = [p.grad.clone() for p in graphs.params]
    assert all(p.grad is b for p, b in zip(graphs.params, graphs.grad_buffers))
    assert graphs.logps(score, second[0], second[1], 9, compute_entropy=False) is None  # 80 -> a new bucket
    # tried twice (the second after an eager pass), each failure recovered from
    assert graphs.failure.startswith("RuntimeError: operation not permitted") and graphs.recorder.recovered == 2
    assert graphs.grad_buffers is None and not graphs._entries
    for param, grad in zip(graphs.params, accumulated):
        torch.testing.assert_close(param.grad, grad)  # the step's gradients so far, kept
    # the micro-batch goes on eagerly (TRL's path) and adds to them
    padded = graph_inputs.padded(second[0], second[1], 9, pad_token_id=0)
    loss = score(padded.inputs, padded.window)[0].sum()
    eager = torch.autograd.grad(loss, graphs.params, retain_graph=True, allow_unused=True)
    loss.backward()
    for param, grad, added in zip(graphs.params, accumulated, eager):
        torch.testing.assert_close(param.grad, grad + (added if added is not None else 0))
    strict = training_graphs.TrainingGraphs(model, pad_token_id=0, eager_on_failure=False,
                                            recorder=FailingRecorder(succeed=0))
    with pytest.raises(RuntimeError, match="stream is capturing"):
        strict.logps(score, first[0], first[1], 9, compute_entropy=False)


class CaptureFlagRecorder(EagerRecorder):
    """Says whether a function is being recorded (``capturing``), as the real recorder's capture would."""

    capturing = False

    def record(self, fn, pool, model=None):
        self.capturing = True
        try:
            return super().record(fn, pool, model)
        finally:
            self.capturing = False


def test_captures_run_without_the_deepspeed_engines_forward_hooks_and_keep_the_others():
    # Seen on an H100 under zero2.yaml and one-process zero3.yaml: from the engine's third optimizer step on, its
    # forward pre-hook (the throughput timer) waits for the device, which ends a capture; every later capture
    # failed and the run went eager. The engine's hooks are lifted for a capture (training and scoring) and run in
    # the eager passes; other hooks (PEFT's, accelerate's) still run in the capture.
    model = checkpointed_model()
    recorder = CaptureFlagRecorder()
    seen = {"engine": [], "other": []}

    def engine_hook(module, args, kwargs):
        seen["engine"].append(recorder.capturing)

    def other_hook(module, args):
        seen["other"].append(recorder.capturing)

    engine_hook.__module__ = "deepspeed.runtime.engine"  # where DeepSpeedEngine defines its forward hooks
    model.register_forward_pre_hook(engine_hook, with_kwargs=True)
    model.register_forward_pre_hook(other_hook)
    hooks_before = list(model._forward_pre_hooks.values())
    score = windowed_score(model)
    graphs = training_graphs.TrainingGraphs(model, pad_token_id=0, recorder=recorder)
    ids, mask, _ = batch(4, prompt=13, completion=9, seed=1)
    with torch.no_grad():
        graphs.scorer(score, model, False)(ids, mask, 9)
    graphs.logps(score, ids, mask, 9, compute_entropy=False)[0].sum().backward()
    assert graphs.failure is None and graphs.captures == 2
    assert seen["engine"] and not any(seen["engine"]), "the engine's hook ran inside a capture"
    assert True in seen["other"], "a hook that is not the engine's was lifted too"
    assert list(model._forward_pre_hooks.values()) == hooks_before  # back, in their order
    assert model._forward_pre_hooks_with_kwargs  # the engine's still takes its kwargs


class OnceFailingRecorder(EagerRecorder):
    """Fails one capture, the ``fail_at``-th recorded function, as a capture that something else ended does."""

    def __init__(self, fail_at: int):
        self.fail_at, self.recorded, self.recovered = fail_at, 0, 0

    def record(self, fn, pool, model=None):
        self.recorded += 1
        if self.recorded == self.fail_at:
            raise RuntimeError("operation failed due to a previous error during capture")
        return super().record(fn, pool, model)

    def recover(self):
        self.recovered += 1


@pytest.mark.parametrize("setting", ["auto", "on"])
def test_a_capture_that_fails_once_is_captured_again_and_the_run_keeps_its_graphs(setting):
    # Seen on an H100: a longer bucket's first capture mid-run ended by something inside it. Given up, every later
    # micro-batch ran eager; tried once more (after an eager pass) the bucket is captured, and every micro-batch
    # gives the eager log-probs and gradients, the step's gradients so far kept.
    model = checkpointed_model()
    score = windowed_score(model)
    graphs = training_graphs.TrainingGraphs(model, pad_token_id=0, recorder=OnceFailingRecorder(fail_at=3),
                                            eager_on_failure=setting == "auto")
    expected = [torch.zeros_like(p) for p in graphs.params]
    for ids, mask, _ in [batch(4, prompt=13, completion=9, seed=1), batch(4, prompt=80, completion=9, seed=2),
                         batch(4, prompt=11, completion=9, seed=3)]:  # the second's forward capture fails once
        weights = torch.arange(1.0, 5.0).unsqueeze(1)
        got, _ = graphs.logps(score, ids, mask, 9, compute_entropy=False)
        (got * weights).sum().backward()
        padded = graph_inputs.padded(ids, mask, 9, pad_token_id=0)
        eager_logps = score(padded.inputs, padded.window)[0]
        torch.testing.assert_close(got, eager_logps[:, :9], rtol=1e-5, atol=1e-6)
        eager = torch.autograd.grad((eager_logps * weights).sum(), graphs.params)
        expected = [total + grad for total, grad in zip(expected, eager)]
    assert graphs.failure is None and graphs.recorder.recovered == 1
    assert graphs.captures == 3  # the first bucket, the second on its second attempt, the first again (let go)
    for param, grad in zip(graphs.params, expected):
        torch.testing.assert_close(param.grad, grad, rtol=1e-4, atol=1e-6)


def test_a_capture_whose_handed_over_backward_reaches_no_trained_parameter_goes_on_eagerly():
    # Reentrant checkpointing (TRL's for a PEFT model under ZeRO-3): handed over, the backward asks autograd.grad for
    # the parameters' gradients, which reaches none inside a reentrant checkpoint. A replay would hand nothing over
    # (DeepSpeed then refused the loss); the capture fails instead, and "auto" goes on with eager micro-batches.
    model = build_tiny_model(build_char_tokenizer(), attn_implementation="sdpa")
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": True})
    model.enable_input_require_grads()
    for name, param in model.named_parameters():
        param.requires_grad_(".layers." in name)  # trained weights inside the checkpointed layers only, as LoRA's
    model.train()
    install_chunked_lm_head(model, temperature=0.7, chunk_rows=5, return_entropy=True)
    graphs = training_graphs.TrainingGraphs(model, pad_token_id=0, recorder=EagerRecorder(), hand_over=True)
    ids, mask, _ = batch(4, prompt=13, completion=9, seed=1)
    assert graphs.logps(windowed_score(model), ids, mask, 9, compute_entropy=False) is None
    assert "reaches no trained parameter" in graphs.failure


def test_reentrant_checkpointing_keeps_handed_over_micro_batches_eager():
    handed_over = RunFacts(device_type="cuda", deepspeed=True, attention="sdpa", reentrant_checkpointing=True)
    assert "reentrant activation checkpointing" in training_graphs.unavailable_reason(handed_over, trainer_sizes())
    # one GPU, no DeepSpeed: the backward accumulates into .grad, which a reentrant checkpoint reaches
    plain = dataclasses.replace(handed_over, deepspeed=False)
    assert training_graphs.unavailable_reason(plain, trainer_sizes()) is None


def test_the_diffusion_trainer_says_it_scores_its_own_way():
    from hf_grpo.diffusion.trainer import DiffuGRPOTrainer

    facts = RunFacts(device_type="cuda", training_graphs_unavailable=DiffuGRPOTrainer.training_graphs_unavailable)
    assert training_graphs.unavailable_reason(facts, trainer_sizes()) == (  # the class's reason, before the device's
        "the diffusion trainer scores completions with its own estimator")


def grpo_run(tmp_path, checkpoint, graphs: str, lora: bool = False, use_cpu: bool = False, num_iterations: int = 1,
             padding_free: bool = False, bf16: bool = False, compile_training: str = "off"):
    """``(trainable parameters before, after, trainer)`` of 3 GRPO steps from ``checkpoint``."""
    import hf_grpo
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    config = hf_grpo.GRPOConfig(
        output_dir=str(tmp_path / f"{graphs}{lora}{num_iterations}{padding_free}{compile_training}"), report_to=[],
        bf16=bf16, max_steps=3, seed=0, use_cpu=use_cpu, num_iterations=num_iterations, padding_free=padding_free,
        per_device_train_batch_size=4, gradient_accumulation_steps=2, num_generations=4, max_completion_length=6,
        learning_rate=0.01, optim="sgd", max_grad_norm=1.0, logging_steps=1, save_strategy="no", disable_tqdm=True,
        generation_backend="hf", beta=0.04, activation_checkpointing=True, temperature=0.7,
        training_cuda_graphs=graphs, compile_training=compile_training)
    peft_config = None
    if lora:
        from peft import LoraConfig

        peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    prompts = ["ab>", "c>", "defghij>", "ij>", "klmnopqrstu>", "v>", "wx>", "yz>"]
    trainer = hf_grpo.GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(checkpoint, attn_implementation="sdpa"), args=config,
        processing_class=AutoTokenizer.from_pretrained(checkpoint, padding_side="left"),
        reward_funcs=lambda completions, **kw: [float(sum(map(ord, c)) % 7) for c in completions],
        train_dataset=Dataset.from_dict({"prompt": prompts * 2}), peft_config=peft_config)

    def trainable():
        return torch.cat([p.detach().flatten() for p in trainer.model.parameters() if p.requires_grad])

    before = trainable().clone()
    trainer.train()
    return before, trainable(), trainer


RUNS = {"full": (False, 1, False), "lora": (True, 1, False), "num_iterations_2": (False, 2, False),
        "packed_lora_num_iterations_2": (True, 2, True)}  # lora, num_iterations, padding_free


@pytest.mark.slow
@pytest.mark.parametrize("lora, num_iterations, padding_free", RUNS.values(), ids=RUNS.keys())
def test_a_grpo_run_through_the_replay_path_updates_as_eager_on_a_cpu(tmp_path, monkeypatch, lora, num_iterations,
                                                                      padding_free):
    # Everything but the capture: buckets, positions, the static head, the autograd node, the gradient buffers
    # adopted across micro-batches and optimizer steps (the Trainer sets gradients to None), the perf counter.
    from hf_grpo.recipe_support.tiny import save_tiny_checkpoint

    monkeypatch.setattr(training_graphs, "unavailable_reason", lambda *a: None)
    # (on a GPU, packed rows replay in fp16/bf16 only, through variable-length flash attention; on a CPU in fp32)
    monkeypatch.setattr(training_graphs, "unpacked_reason",
                        lambda setting, model, facts: None if setting else "padding_free=False")
    monkeypatch.setattr(training_graphs, "CudaGraphRecorder", EagerRecorder)
    checkpoint = save_tiny_checkpoint(tmp_path / "checkpoint")
    run = dict(use_cpu=True, num_iterations=num_iterations, padding_free=padding_free)
    _, eager_params, eager = grpo_run(tmp_path, checkpoint, "off", lora, **run)
    replayed = []
    replay = graph_buckets.Replay.apply
    monkeypatch.setattr(graph_buckets.Replay, "apply", lambda *a: replayed.append(1) or replay(*a))
    _, graphed_params, trainer = grpo_run(tmp_path, checkpoint, "on", lora, **run)
    graphs = trainer.decisions.train_graphs
    assert eager.decisions.train_graphs is None and graphs is not None and graphs.failure is None
    assert graphs.packed == padding_free
    assert all(key[1] == ("packed" if padding_free else "padded") for key in graphs._entries)
    assert len(replayed) == 6  # 3 steps x 2 micro-batches, every one through the replay path
    # and the reference (LoRA: the policy without its adapters), with num_iterations 2 the old policy too, through
    # forward-only graphs
    assert len({key[0] for key in graphs._scoring}) == num_iterations
    assert trainer.get_performance_stats()["train_graph_captures"] == graphs.captures >= 1
    assert all(p.grad is None or p.grad is b for p, b in zip(graphs.params, graphs.grad_buffers))
    torch.testing.assert_close(graphed_params, eager_params, rtol=1e-5, atol=1e-6)
    # the reference is scored in the training graphs' shapes: at step 1, where the policy is the reference, no KL
    kl = [[log["kl"] for log in run.state.log_history if "kl" in log] for run in (eager, trainer)]
    assert kl[1][0] == kl[0][0] == 0.0, kl


@pytest.mark.slow
def test_compiled_layers_and_packed_graphs_update_as_eager_on_a_cpu(tmp_path, monkeypatch):
    # What "auto" picks on one GPU for runs of 50 steps or more: compiled layers (here torch.compile's
    # aot_eager_decomp_partition backend, which partitions as inductor does), packed rows, replayed micro-batches,
    # every bucket warmed up first (a compiled layer may compile again for a new shape).
    import functools

    from hf_grpo.training import compiled_layers as training_compile
    from hf_grpo.recipe_support.tiny import save_tiny_checkpoint

    monkeypatch.setattr(training_graphs, "unavailable_reason", lambda *a: None)
    monkeypatch.setattr(training_graphs, "unpacked_reason", lambda *a: None)
    monkeypatch.setattr(training_graphs, "CudaGraphRecorder", EagerRecorder)
    monkeypatch.setattr(training_compile, "CompiledTrainingLayers", functools.partial(
        training_compile.CompiledTrainingLayers, backend="aot_eager_decomp_partition"))
    checkpoint = save_tiny_checkpoint(tmp_path / "checkpoint")
    torch._dynamo.reset()  # the compile counted below is this test's own
    _, eager_params, _ = grpo_run(tmp_path, checkpoint, "off", use_cpu=True, padding_free=True)
    _, graphed_params, trainer = grpo_run(tmp_path, checkpoint, "on", use_cpu=True, padding_free=True,
                                          compile_training="on")
    graphs = trainer.decisions.train_graphs
    assert trainer.decisions.train_layers is not None and trainer.decisions.train_layers.compiles > 0
    assert graphs.failure is None and graphs.warmup_passes == training_graphs.WARMUP_PASSES["compiled"]
    assert graphs._entries and all(key[1] == "packed" for key in graphs._entries)
    torch.testing.assert_close(graphed_params, eager_params, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("lora, num_iterations, padding_free", RUNS.values(), ids=RUNS.keys())
def test_a_grpo_run_with_training_graphs_updates_as_eager(tmp_path, lora, num_iterations, padding_free):
    # From a saved checkpoint, with a reference model (or LoRA's disabled adapters), activation checkpointing,
    # prompts of varied length and two micro-batches a step: the replayed steps give the eager updates.
    from hf_grpo.recipe_support.tiny import save_tiny_checkpoint

    checkpoint = save_tiny_checkpoint(tmp_path / "checkpoint")
    # packed rows replay in fp16/bf16 only (variable-length flash attention)
    run = dict(num_iterations=num_iterations, padding_free=padding_free, bf16=padding_free)
    before, eager_params, eager = grpo_run(tmp_path, checkpoint, "off", lora, **run)
    _, graphed_params, trainer = grpo_run(tmp_path, checkpoint, "on", lora, **run)
    assert eager.decisions.train_graphs is None
    assert trainer.decisions.graphs_replay
    assert all(key[1] == ("packed" if padding_free else "padded") for key in trainer.decisions.train_graphs._entries)
    assert trainer.get_performance_stats()["train_graph_captures"] > 0
    if padding_free:  # bf16 rounds the two differently: each run's update within a few percent of the other's
        eager_update, graphed_update = eager_params - before, graphed_params - before
        assert eager_update.norm() > 0
        assert (graphed_update - eager_update).norm() < 0.05 * eager_update.norm()
    else:
        torch.testing.assert_close(graphed_params, eager_params, rtol=1e-4, atol=1e-5)


def windowed_score(model):
    """``score`` as ``training_graphs.replay`` builds it: TRL's labels, the completion window scored statically."""
    def score(inputs, window):
        out = model(**graph_inputs.model_kwargs(inputs, window))
        return out.log_probs[:, -window:], None
    return score


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_later_buckets_replay_the_eager_gradients_and_keep_no_memory_of_their_own():
    # With eager layers a later bucket is captured without an eager pass first; its replay gives the eager
    # log-probs and gradients. Capturing it keeps only its static inputs and outputs allocated (a new stream
    # for each capture had cuBLAS keep a 64 MiB workspace for each).
    model = checkpointed_model().cuda()
    score = windowed_score(model)
    graphs = training_graphs.TrainingGraphs(model, pad_token_id=0, eager_on_failure=False)
    held = []
    for prompt in (13, 80, 150, 200):  # buckets 64, 128, 192, 256
        ids, mask, _ = (t.cuda() for t in batch(4, prompt=prompt, completion=9, seed=prompt))
        weights = torch.arange(1.0, 5.0, device="cuda").unsqueeze(1)
        model.zero_grad(set_to_none=True)
        padded = graph_inputs.padded(ids, mask, 9, pad_token_id=0)
        expected = score(padded.inputs, padded.window)[0][:, :9]
        (expected * weights).sum().backward()
        # (the eager graph goes before the capture: its gradient accumulators belong to the default stream)
        expected, expected_grads = expected.detach(), [p.grad.clone() for p in graphs.params]
        model.zero_grad(set_to_none=True)
        got, _ = graphs.logps(score, ids, mask, 9, compute_entropy=False)
        (got * weights).sum().backward()
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
        for param, grad in zip(graphs.params, expected_grads):
            torch.testing.assert_close(param.grad, grad, rtol=1e-4, atol=1e-6)
        torch.cuda.synchronize()
        held.append(torch.cuda.memory_allocated())
    assert graphs.captures == 4 and graphs.failure is None
    assert held[-1] - held[0] < 4 * 2**20, [h / 2**20 for h in held]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_failed_capture_leaves_auto_eager_and_the_random_stream_usable():
    # A forward that waits on the host cannot be captured: "auto" goes on eagerly (and later random draws work,
    # which a capture broken half-way would otherwise stop); "on" raises the error.
    model = torch.nn.Linear(4, 4).cuda()

    def syncing_score(inputs, window):
        out = model(inputs["input_ids"].float().unsqueeze(-1).expand(-1, -1, 4)).sum(-1)[:, -window:]
        if out.sum() > 1e9:  # a host sync
            out = out * 2
        return out, None

    ids, mask = torch.ones(2, 8, dtype=torch.long, device="cuda"), torch.ones(2, 8, dtype=torch.long, device="cuda")
    graphs = training_graphs.TrainingGraphs(model, pad_token_id=0, eager_on_failure=True)
    torch.manual_seed(0)
    expected = torch.rand(3, device="cuda")
    torch.manual_seed(0)
    assert graphs.logps(syncing_score, ids, mask, completion_width=4, compute_entropy=False) is None
    assert graphs.failure is not None and "capture" in graphs.failure
    torch.testing.assert_close(torch.rand(3, device="cuda"), expected)  # the stream, as if nothing was captured
    strict = training_graphs.TrainingGraphs(model, pad_token_id=0, eager_on_failure=False)
    with pytest.raises(Exception, match="capture"):
        strict.logps(syncing_score, ids, mask, completion_width=4, compute_entropy=False)
    torch.rand(3, device="cuda")  # usable after the error too


def test_the_rollouts_scoring_is_done_in_the_replayed_shapes_so_bf16_gives_the_same_bits():
    # bf16 rounds differently in other shapes: a reference scored unpadded would differ from the policy's replayed
    # log-probs at equal weights (a KL at step 1); scored padded to the same bucket, the bits are the same.
    model = checkpointed_model().to(torch.bfloat16)
    ids, mask, _ = batch(8, prompt=13, completion=9, seed=2)
    score = windowed_score(model)

    graphs = training_graphs.TrainingGraphs(model, pad_token_id=0, recorder=EagerRecorder())

    def eager(rows_ids, rows_mask, width):  # the same static form, run eagerly
        static = graphs.static_inputs(rows_ids, rows_mask, width)
        return static.spread(score(static.inputs, static.window)[0]), None

    with torch.no_grad():
        reference, _ = training_graphs.chunked_scoring(eager, ids, mask, 9, rows=8)
        # as the trainer scores the rollout: through a forward-only graph of the same bucket
        replayed_reference, _ = training_graphs.chunked_scoring(graphs.scorer(score, model, False), ids, mask, 9,
                                                                rows=8)
    assert torch.equal(replayed_reference, reference)
    for start in (0, 4):  # two training micro-batches of 4 rows
        replayed, _ = graphs.logps(score, ids[start:start + 4], mask[start:start + 4], 9, compute_entropy=False)
        assert torch.equal(replayed.detach(), reference[start:start + 4])


@pytest.mark.slow
def test_a_grpo_run_whose_new_shapes_replay_larger_ones_updates_as_eager_on_a_cpu(tmp_path, monkeypatch):
    # The same whole run with rows packed and new shapes replayed in a captured larger one (shape_reuse): the tiny
    # run's packed lengths are 64 and 128, so a micro-batch of 64 replays at 128 for twice its own work.
    from hf_grpo.recipe_support.tiny import save_tiny_checkpoint

    monkeypatch.setattr(training_graphs, "unavailable_reason", lambda *a: None)
    monkeypatch.setattr(training_graphs, "unpacked_reason", lambda *a: None)
    monkeypatch.setattr(training_graphs, "CudaGraphRecorder", EagerRecorder)
    checkpoint = save_tiny_checkpoint(tmp_path / "checkpoint")
    _, eager_params, _ = grpo_run(tmp_path, checkpoint, "off", use_cpu=True, padding_free=True)
    _, graphed_params, trainer = grpo_run(tmp_path, checkpoint, "on", use_cpu=True, padding_free=True)
    graphs = trainer.decisions.train_graphs
    assert graphs.failure is None and graphs.reuse.reused > 0
    assert trainer.get_performance_stats()["train_graph_reuses"] == graphs.reuse.reused
    torch.testing.assert_close(graphed_params, eager_params, rtol=1e-5, atol=1e-6)
