"""Rows of one prompt run its tokens once (hf_grpo.training.padding_free, ``shared_prefix``), and a prompt's rows go
into the same micro-batches where that leaves the step as it is (hf_grpo.training.prompt_groups).

GRPO scores every prompt's completions in rows that repeat the prompt: packed, those rows share the prompt's
tokens, which the layers then run once. A causal model's prompt states do not depend on what follows, so the
log-probs, entropies and every parameter's gradient must equal the padded forward's (fp32 on CPU, to 1e-5), while
the backbone sees each prompt once; a step with the rows grouped must update as one with TRL's shuffled rows.
"""

import pytest
import torch

from hf_grpo.training import graph_inputs, padding_free
from tests.training.test_padding_free import assert_packed_scores_as_padded, build
from tests.tolerances import backward_terms, reordered

# rows 0, 2 and 3 repeat one prompt, 1 and 5 another; 4 has the first one's length but other tokens
PROMPTS = ("A", "B", "A", "A", "C", "B")
PROMPT_LENGTH = {"A": 5, "B": 3, "C": 5}
COMPLETION_LENGTHS = (4, 1, 6, 3, 2, 5)


def grouped_batch(vocab: int, seed: int = 0):
    """input_ids, attention_mask and TRL's labels for rows whose prompts repeat (left-padded prompts, right-padded
    completions)."""
    gen = torch.Generator().manual_seed(seed)
    width_p, width_c = max(PROMPT_LENGTH.values()), max(COMPLETION_LENGTHS)
    prompt_ids = {name: torch.randint(2, vocab, (n,), generator=gen) for name, n in PROMPT_LENGTH.items()}
    ids = torch.zeros(len(PROMPTS), width_p + width_c, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, (name, c) in enumerate(zip(PROMPTS, COMPLETION_LENGTHS)):
        p = PROMPT_LENGTH[name]
        ids[row, width_p - p:width_p] = prompt_ids[name]
        ids[row, width_p:width_p + c] = torch.randint(2, vocab, (c,), generator=gen)
        mask[row, width_p - p:width_p + c] = 1
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :width_p] = -100
    return ids, mask, labels


UNIQUE_TOKENS = sum(PROMPT_LENGTH.values()) + sum(COMPLETION_LENGTHS)


@pytest.mark.parametrize("family", ["qwen2", "llama"])
@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "activation_checkpointing"])
def test_rows_of_one_prompt_score_as_padded_rows(family, checkpointing):
    # every prompt once
    assert_packed_scores_as_padded(family, checkpointing, grouped_batch, UNIQUE_TOKENS)


def test_shared_layout_gathers_every_row_whole():
    ids, mask, _ = grouped_batch(40)
    rows = padding_free.pack_rows(ids, mask, ids.shape[1] - max(COMPLETION_LENGTHS))
    assert rows.tokens == UNIQUE_TOKENS
    # the keys a row reads are its whole row, in the order packing without sharing lays rows out
    assert rows.input_ids[0, rows.key_index].tolist() == ids[mask.bool()].tolist()
    full = [PROMPT_LENGTH[name] + c for name, c in zip(PROMPTS, COMPLETION_LENGTHS)]
    assert rows.cu_key_lens.tolist() == [0, *torch.tensor(full).cumsum(0).tolist()]
    own = [n - (PROMPT_LENGTH[name] if name in PROMPTS[:row] else 0)
           for row, (name, n) in enumerate(zip(PROMPTS, full))]
    assert [end - start for start, end in rows.bounds] == own
    # a later row's completion continues its prompt's positions
    start, end = rows.bounds[2]
    assert rows.position_ids[0, start:end].tolist() == list(range(5, 5 + COMPLETION_LENGTHS[2]))
    assert rows.longest == max(full)


def test_no_shared_prefix_packs_every_row_whole():
    ids, mask, _ = grouped_batch(40)
    rows = padding_free.pack_rows(ids, mask)
    assert rows.key_index is None and rows.tokens == int(mask.sum())


def test_dropout_in_training_keeps_every_row_its_own_prompt():
    # each row's copy of the prompt would draw its own dropout mask: no sharing while a dropout draws
    model = build("qwen2", "sdpa")
    model.eval()
    assert padding_free.shares_prompts(model)
    model.train()
    assert padding_free.shares_prompts(model)
    dropped = build("qwen2", "sdpa")
    dropped.model.layers[0].mlp.add_module("drop", torch.nn.Dropout(0.1))
    dropped.train()
    assert not padding_free.shares_prompts(dropped)
    dropped.eval()
    assert padding_free.shares_prompts(dropped)


def test_a_shared_micro_batch_in_the_graphs_static_form_keeps_every_log_prob_and_gradient():
    # as the training graphs replay it: bucketed lengths, the keys gathered into a longer sequence whose end is the
    # padding row's, at its own shape and at a captured larger one (shape reuse)
    from tests.training.test_training_graphs import checkpointed_model, logps_and_grads

    model = checkpointed_model()
    ids, mask, labels = grouped_batch(model.config.vocab_size)
    expected = logps_and_grads(model, ids, mask, labels)
    completion = max(COMPLETION_LENGTHS)
    own = graph_inputs.packed(model, ids, mask, completion, pad_token_id=0)
    saved = int(mask.sum()) - UNIQUE_TOKENS  # the prompt tokens sharing does not run again
    assert own.key == ("packed", graph_inputs.bucket(UNIQUE_TOKENS + 1, 4), graph_inputs.bucket(saved, 4))
    larger = graph_inputs.packed(model, ids, mask, completion, pad_token_id=0,
                                 fit=lambda length, shared, window: (length + 64, shared + 64, window * 2))
    for batch in (own, larger):
        length, shared = batch.key[1:]
        assert batch.inputs["key_index"].shape == (length + shared,)
        assert batch.inputs["cu_key_lens"].tolist()[-1] == length + shared
        model.zero_grad()
        logps = batch.spread(model(**graph_inputs.model_kwargs(batch.inputs, batch.window)).log_probs)
        (logps * torch.arange(1.0, ids.shape[0] + 1).unsqueeze(1)).sum().backward()
        torch.testing.assert_close(logps, expected[0][:, -completion:], rtol=1e-5, atol=1e-6)
        terms = backward_terms(model.config, ids.numel())
        for name, param in model.named_parameters():  # summed in another order than the padded batch's
            torch.testing.assert_close(param.grad, expected[2][name], **reordered(expected[2][name], terms), msg=name)


def test_a_micro_batch_without_shared_prompts_replays_a_shared_shape():
    from tests.training.test_training_graphs import checkpointed_model, logps_and_grads

    model = checkpointed_model()
    ids, mask, labels = grouped_batch(model.config.vocab_size)
    ids, mask, labels = ids[:2], mask[:2], labels[:2]  # prompts A and B: nothing shared
    expected = logps_and_grads(model, ids, mask, labels)
    own = graph_inputs.packed(model, ids, mask, max(COMPLETION_LENGTHS), pad_token_id=0)
    assert own.key[2] == 0 and "key_index" not in own.inputs
    wider = graph_inputs.packed(model, ids, mask, max(COMPLETION_LENGTHS), pad_token_id=0,
                                fit=lambda length, shared, window: (length, 64, window))
    model.zero_grad()
    logps = wider.spread(model(**graph_inputs.model_kwargs(wider.inputs, wider.window)).log_probs)
    (logps * torch.arange(1.0, 3.0).unsqueeze(1)).sum().backward()
    torch.testing.assert_close(logps, expected[0][:, -max(COMPLETION_LENGTHS):], rtol=1e-5, atol=1e-6)
    terms = backward_terms(model.config, ids.numel())
    for name, param in model.named_parameters():  # summed in another order than the padded batch's
        torch.testing.assert_close(param.grad, expected[2][name], **reordered(expected[2][name], terms), msg=name)


def grouped_step(tmp_path, monkeypatch, group: bool, **overrides):
    from tests.test_trainer import make_trainer, train_one_step

    from hf_grpo.training import prompt_groups

    monkeypatch.setattr(prompt_groups, "GROUP_PROMPTS", group)
    values = dict(padding_free=True, per_device_train_batch_size=4, num_generations=4, gradient_accumulation_steps=2,
                  loss_type="dapo")  # (a reference model: test_trl_parity's padding-free runs)
    trainer = make_trainer(tmp_path / str(group), **{**values, **overrides})
    return trainer, train_one_step(trainer)


def lora_policy():
    from peft import LoraConfig, get_peft_model

    from hf_grpo.recipe_support.tiny import build_tiny_model
    from tests.test_trainer import TOKENIZER

    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False)
    return get_peft_model(build_tiny_model(TOKENIZER, seed=0), config)


@pytest.mark.parametrize("loss_type, lora", [("dapo", False), ("grpo", False), ("dr_grpo", False), ("dapo", True)])
def test_a_prompt_s_rows_grouped_into_micro_batches_update_as_trl_s_shuffle(tmp_path, monkeypatch, loss_type, lora):
    # TRL shuffles a rollout's rows before splitting them into micro-batches; grouped by prompt instead, each
    # micro-batch shares one prompt, and the step (every micro-batch in one optimizer step) updates the same
    from tests.test_trainer import assert_same_update

    policy = (lambda: {"model": lora_policy()}) if lora else dict
    shuffled, want = grouped_step(tmp_path, monkeypatch, False, loss_type=loss_type, **policy())
    grouped, got = grouped_step(tmp_path, monkeypatch, True, loss_type=loss_type, **policy())
    assert grouped.decisions.prompt_grouping == "on"
    assert "turned off" in shuffled.decisions.prompt_grouping
    for micro_batch in grouped._buffered_inputs:
        prompts = micro_batch["prompt_ids"].masked_fill(micro_batch["prompt_mask"] == 0, -1)
        assert (prompts == prompts[0]).all(), "a micro-batch holds the rows of one prompt"
    assert_same_update(got, want)


@pytest.mark.parametrize(("overrides", "reason"), [
    (dict(loss_type="bnpo"), "loss_type='bnpo' normalizes by the micro-batch's own tokens"),
    (dict(loss_type="vespo"), "loss_type='vespo' is not one known to sum the same over any split"),
    (dict(steps_per_generation=4), "steps_per_generation=4 differs from gradient_accumulation_steps=2"),
    (dict(top_entropy_quantile=0.5), "entropy mask or bonus"),
    (dict(padding_free=False), "scored padded"),
])
def test_micro_batches_whose_split_changes_the_step_keep_trl_s_shuffle(tmp_path, monkeypatch, caplog, overrides,
                                                                      reason):
    with caplog.at_level("INFO", logger="hf_grpo"):
        trainer, _ = grouped_step(tmp_path, monkeypatch, True, **overrides)
    assert reason in trainer.decisions.prompt_grouping
    assert f"micro-batches: TRL's shuffled rows ({trainer.decisions.prompt_grouping})" in caplog.text  # the user is told


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_shared_prompts_score_as_padded_rows_in_bf16_on_cuda():
    # On CUDA a later row's queries meet its gathered keys in the variable-length flash kernel, causal from the
    # bottom right; the graphs' static form adds a padding row with more keys than queries.
    from tests.training.test_padding_free import assert_packed_scores_as_padded_in_bf16_on_cuda

    shared, batch, out_shared = assert_packed_scores_as_padded_in_bf16_on_cuda(grouped_batch(40))
    ids, mask, _ = batch
    expected = out_shared.log_probs.detach()[:, -max(COMPLETION_LENGTHS):]
    static = graph_inputs.packed(shared, ids, mask, max(COMPLETION_LENGTHS), pad_token_id=0,
                                 fit=lambda length, shared_places, window: (length + 64, shared_places + 64, window))
    assert static.key[2] > 0
    with torch.no_grad():
        logps = static.spread(shared(**graph_inputs.model_kwargs(static.inputs, static.window)).log_probs)
    torch.testing.assert_close(logps.float(), expected.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")])])
def test_compiled_layers_score_shared_prompts_as_eager_layers(device):
    # compile_training: the packed attention is one opaque op to the compiler, its key gather included
    from tests.training.test_training_compile import assert_compiled_equals_eager, checkpointed_pair

    from hf_grpo.training import compiled_layers as training_compile

    eager, compiled_model = checkpointed_pair(padding_free=True, device=device)
    backend = "inductor" if device == "cuda" else "aot_eager_decomp_partition"  # (as inductor partitions)
    layers = training_compile.CompiledTrainingLayers(backend=backend)
    ids, mask, labels = (t.to(device) for t in grouped_batch(eager.config.vocab_size))
    seen = []
    compiled_model.get_input_embeddings().register_forward_hook(lambda m, a, out: seen.append(a[0].shape[1]))
    assert_compiled_equals_eager(eager, compiled_model, layers, (ids, mask, labels), rtol=1e-4, atol=1e-5,
                                 grad_rtol=1e-3)
    assert seen == [UNIQUE_TOKENS] and layers.compiles > 0


def test_a_model_that_cannot_pack_keeps_trl_s_shuffle(tmp_path, monkeypatch):
    # padding_free=True on a model scored padded anyway (here: eager attention) shares nothing, so nothing moves
    from hf_grpo.recipe_support.tiny import build_tiny_model
    from tests.test_trainer import TOKENIZER

    trainer, _ = grouped_step(tmp_path, monkeypatch, True,
                              model=build_tiny_model(TOKENIZER, seed=0, attn_implementation="eager"))
    assert "scored padded" in trainer.decisions.prompt_grouping
