"""Compiled training layers (hf_grpo.training_compile): the same log-probs and gradients as eager, activation
checkpointing's recompute included, and a bounded number of compiles over micro-batches of changing shape."""

import copy

import pytest
import torch

from hf_grpo import training_compile
from hf_grpo.logprob_head import install_chunked_lm_head
from hf_grpo.recipe_support.tiny import build_char_tokenizer, build_tiny_model


def batch(rows: int, prompt: int, completion: int, seed: int):
    """Left-padded prompts and right-padded completions of varied length, with TRL's labels."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, 40, (rows, prompt + completion), generator=gen)
    mask = torch.zeros_like(ids)
    for row in range(rows):
        p = 1 + (row * 3 + seed) % prompt
        c = 1 + (row * 5 + seed) % completion
        mask[row, prompt - p:prompt + c] = 1
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :prompt] = -100
    return ids, mask, labels


def forward_backward(model, ids, mask, labels):
    model.zero_grad()
    out = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
    (out.log_probs.sum() + out.entropy.sum()).backward()
    return out.log_probs.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("padding_free", [False, True], ids=["padded", "packed"])
def test_compiled_layers_equal_eager_and_compile_a_bounded_number_of_times(padding_free):
    eager = build_tiny_model(build_char_tokenizer(), attn_implementation="sdpa")
    eager.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    eager.train()
    compiled_model = copy.deepcopy(eager)
    for model in (eager, compiled_model):
        install_chunked_lm_head(model, temperature=1.0, chunk_rows=7, return_entropy=True,
                                padding_free_rows=padding_free)
    layers = training_compile.CompiledTrainingLayers(backend="aot_eager")
    shapes = [(4, 6, 5), (3, 9, 4), (5, 4, 7), (2, 8, 8)]  # rows, prompt width, completion width
    compiles = []
    for seed, shape in enumerate(shapes):
        inputs = batch(*shape, seed=seed)
        expected_logps, expected_grads = forward_backward(eager, *inputs)
        with layers.route(compiled_model):
            logps, grads = forward_backward(compiled_model, *inputs)
        compiles.append(layers.compiles)
        torch.testing.assert_close(logps, expected_logps, rtol=1e-5, atol=1e-6)
        assert grads.keys() == expected_grads.keys()
        for name, grad in expected_grads.items():
            torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)
    # Dynamic shapes: the graphs compiled for the first shapes serve the later ones.
    assert compiles[0] > 0 and compiles[-1] == compiles[1], compiles
    # Outside the block the layers run their own forward again.
    assert all("forward" not in vars(layer) for layer in compiled_model.model.layers)


def test_suspended_layers_run_their_own_forward():
    model = build_tiny_model(build_char_tokenizer())
    layers = training_compile.CompiledTrainingLayers(backend="eager")
    with layers.route(model):
        assert all("forward" in vars(layer) for layer in model.model.layers)
        with layers.suspended():
            assert all("forward" not in vars(layer) for layer in model.model.layers)
        assert all("forward" in vars(layer) for layer in model.model.layers)


@pytest.mark.parametrize(
    ("setting", "device", "sharded", "reason"),
    [
        ("off", "cuda", None, "compile_training='off'"),
        ("auto", "cpu", None, "compiles on CUDA only"),
        ("on", "cuda", "ZeRO-3", "ZeRO-3 shards the parameters"),
    ],
)
def test_choose_says_why_not(setting, device, sharded, reason):
    model = build_tiny_model(build_char_tokenizer())
    chosen, why = training_compile.choose(setting, [model], torch.device(device), sharded)
    assert chosen is None and reason in why


def test_bad_setting_is_named(make_config):
    with pytest.raises(ValueError, match=r"compile_training must be one of \['auto', 'on', 'off'\], got 'yes'"):
        make_config(compile_training="yes")
