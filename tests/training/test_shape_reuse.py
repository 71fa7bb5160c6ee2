"""A new packed shape's first micro-batches replayed in a captured larger shape (hf_grpo.training.shape_reuse):
which shape is chosen, and that the larger shape gives the micro-batch's own log-probs and gradients, training and
scoring alike (on a CPU, the capture stood in by an eager replay as in test_training_graphs)."""

import contextlib

import pytest
import torch

from hf_grpo.memory.stats import PerformanceStats
from hf_grpo.recipe_support.tiny import build_char_tokenizer, build_tiny_model
from hf_grpo.training import graph_inputs
from hf_grpo.training import graphs as training_graphs
from hf_grpo.training.shape_reuse import Shape, ShapeReuse, head_share

from tests.training.test_training_graphs import EagerRecorder, checkpointed_model, windowed_score

COMPLETION = 9


def rows(prompts: list[int], seed: int):
    """Left-padded prompts of the given lengths, each with a completion of ``COMPLETION`` tokens."""
    width = max(prompts)
    ids = torch.randint(2, 40, (len(prompts), width + COMPLETION), generator=torch.Generator().manual_seed(seed))
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        mask[row, width - prompt:] = 1
    return ids, mask


LARGE = rows([70, 70, 60, 60], seed=1)  # 296 tokens: packed length 320
SMALL = rows([50, 50, 50, 50], seed=2)  # 236 tokens: packed length 256, a quarter less


def packed_length(ids, mask, model):
    return graph_inputs.packed(model, ids, mask, COMPLETION, pad_token_id=0).key[1]


def eager_logps_and_grads(model, ids, mask):
    """The micro-batch unpacked and eager, as TRL scores it: log-probs of the completion, and the gradients of a
    loss that weighs rows unequally."""
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :-COMPLETION] = -100
    model.zero_grad(set_to_none=True)
    logps = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True).log_probs[:, -COMPLETION:]
    (logps * torch.arange(1.0, 5.0).unsqueeze(1)).sum().backward()
    return logps.detach(), [p.grad.clone() for p in model.parameters()]


def test_the_two_micro_batches_have_the_lengths_the_tests_rely_on():
    model = checkpointed_model()
    assert packed_length(*LARGE, model) == 320 and packed_length(*SMALL, model) == 256


def test_a_new_shape_replays_a_larger_captured_one_twice_then_gets_its_own_with_the_eager_gradients():
    model = checkpointed_model()
    graphs = training_graphs.TrainingGraphs(model, pad_token_id=0, recorder=EagerRecorder(), packed=True,
                                            reuse=ShapeReuse(head_share=0.0, capture_cost=0.5))
    perf = PerformanceStats()
    for step, (ids, mask) in enumerate([LARGE, SMALL, SMALL, SMALL]):
        expected, expected_grads = eager_logps_and_grads(model, ids, mask)
        model.zero_grad(set_to_none=True)
        got, _, _ = training_graphs.replay(graphs, perf, contextlib.nullcontext, model, ids, mask, COMPLETION)
        (got * torch.arange(1.0, 5.0).unsqueeze(1)).sum().backward()
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
        for param, grad in zip(model.parameters(), expected_grads):
            torch.testing.assert_close(param.grad, grad, rtol=1e-5, atol=1e-6 * float(grad.abs().max()))
        stats = perf.summary()
        # the small shape: replayed at length 320 twice (a quarter more work each), captured at its third
        # micro-batch, where the extra work would pass half a micro-batch
        assert (stats["train_graph_captures"], stats["train_graph_reuses"]) == [(1, 0), (1, 1), (1, 2), (2, 2)][step]
    assert sorted(shape.length for shape in graphs._entries) == [256, 320]


def test_the_rollouts_scoring_replays_a_larger_shape_of_the_same_model_only():
    model = checkpointed_model()
    graphs = training_graphs.TrainingGraphs(model, pad_token_id=0, recorder=EagerRecorder(), packed=True,
                                            reuse=ShapeReuse(head_share=0.0))
    score = windowed_score(model)
    model.eval()
    with torch.no_grad():
        graphs.scorer(score, model, False)(*LARGE, COMPLETION)
        small, _ = graphs.scorer(score, model, False)(*SMALL, COMPLETION)
        assert graphs.reuse.reused == 1 and graphs.captures == 1
        natural = graphs.static_inputs(*SMALL, COMPLETION)
        torch.testing.assert_close(small, natural.spread(score(natural.inputs, natural.window)[0]),
                                   rtol=1e-5, atol=1e-6)
        # another model's scoring (the reference) has no graph to replay yet: its first chunk is captured
        reference = checkpointed_model().eval()
        graphs.scorer(windowed_score(reference), reference, False)(*SMALL, COMPLETION)
    assert graphs.reuse.reused == 1 and graphs.captures == 2


def test_a_packed_micro_batch_built_at_a_larger_shape_scores_as_its_own():
    model = checkpointed_model()
    own = graph_inputs.packed(model, *SMALL, COMPLETION, pad_token_id=0)
    larger = graph_inputs.packed(model, *SMALL, COMPLETION, pad_token_id=0,
                                 fit=lambda length, shared, window: (320, shared, 128))
    assert (larger.key, larger.window) == (("packed", 320, 0), 128)
    assert larger.inputs["input_ids"].shape == (1, 320) and larger.inputs["labels"].shape == (1, 128)
    assert larger.inputs["cu_seq_lens"].tolist()[-2:] == [236, 320]  # one longer padding row
    score = windowed_score(model)
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(larger.spread(score(larger.inputs, 128)[0]), own.spread(score(own.inputs, 64)[0]),
                                   rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match=r"length 256, 0 shared places and scored width 64 cannot be built as \(192"):
        graph_inputs.packed(model, *SMALL, COMPLETION, pad_token_id=0,
                            fit=lambda length, shared, window: (192, shared, 64))


def shape(length, window=64, rows=8, entropy=False, layout="packed", shared=0):
    return Shape(rows, layout, length, shared, window, entropy)


def test_the_cheapest_captured_shape_that_fits_is_chosen():
    reuse = ShapeReuse(head_share=0.5, capture_cost=2.0)
    captured = [shape(2560), shape(3072), shape(2048, window=128), shape(2304, rows=4), shape(2304, entropy=True)]
    # work 2048 + 32 = 2080: 2560 + 32 costs 24% more and fits; 2048 + 64 costs 1.5% more and is cheaper
    assert reuse.choose("train", shape(2048), captured) == shape(2048, window=128)
    assert reuse.reused == 1
    # another number of rows, or entropies where none were asked for, does not fit
    assert reuse.choose("train", shape(2300), captured[3:]) == shape(2300)
    # one replay in a shape of three times its work would cost more than its capture: captured at once
    assert reuse.choose("train", shape(1000), [shape(3072)]) == shape(1000)
    assert reuse.reused == 1


def test_a_new_shape_is_captured_once_its_replays_in_larger_ones_would_cost_more_than_its_capture():
    reuse = ShapeReuse(head_share=0.0, capture_cost=1.0)
    captured = [shape(320)]  # a quarter more work than 256 each time: four replays cost one capture
    assert [reuse.choose("train", shape(256), captured) for _ in range(5)] == [shape(320)] * 4 + [shape(256)]
    assert reuse.choose("reference", shape(256), captured) == shape(320)  # counted apart for each owner
    assert reuse.choose("train", shape(256), captured + [shape(256)]) == shape(256)  # captured: its own
    assert reuse.choose("train", shape(5, layout="padded"), [shape(6, layout="padded")]) == shape(5, layout="padded")
    # a fit that costs 1/64 more replays 64 times before the shape is worth a graph of its own
    reuse = ShapeReuse(head_share=0.0, capture_cost=1.0)
    near = [reuse.choose("train", shape(256), [shape(260)]) for _ in range(65)]
    assert near == [shape(260)] * 64 + [shape(256)]
    assert ShapeReuse(head_share=0.0, capture_cost=0).choose("train", shape(256), captured) == shape(256)


def test_bad_settings_are_named():
    with pytest.raises(ValueError, match="capture_cost must be at least 0, got -0.1"):
        ShapeReuse(head_share=0.2, capture_cost=-0.1)


def test_the_head_share_weighs_the_lm_head_against_the_layers():
    model = build_tiny_model(build_char_tokenizer())
    layers = sum(p.numel() for name, p in model.named_parameters() if "embed_tokens" not in name
                 and "lm_head" not in name)
    assert head_share(model) == pytest.approx(model.lm_head.weight.numel() / layers)
    assert head_share(torch.nn.Linear(3, 3)) == 0.0
