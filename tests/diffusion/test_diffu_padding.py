"""A model that ignores the padding mask (the released LLaDA code calls its attention with ``attn_mask=None``):
found by the probe, then never given a padded batch, so each row gets the log-probs and the completion it
gets alone, whichever rows share its chunk."""

import pathlib

import pytest
import torch
from datasets import Dataset
from tests.project_files import load_file

from hf_grpo.diffusion import DiffuGRPOConfig, DiffuGRPOTrainer
from hf_grpo.diffusion.logprobs import EstimatorSpec, masked_logprobs, rollout_mask_seeds
from hf_grpo.diffusion.model import attends_to_padding, left_pad_tensors
from hf_grpo.diffusion.sampler import DiffusionSampler
from hf_grpo.recipe_support.diffusion_tiny import build_diffusion_tokenizer, build_tiny_diffusion_model
from transformers import GenerationConfig

HERE = pathlib.Path(__file__).resolve().parent
TOKENIZER = build_diffusion_tokenizer()
MASK, PAD = TOKENIZER.mask_token_id, TOKENIZER.pad_token_id
# lengths 3, 2, 6, 2, 3, 6, 1: some equal, some not
PROMPTS = ["ab>", "c>", "defgh>", "h>", "ij>", "klmno>", ">"]
SLOTS = 8
STAND_IN = load_file(HERE / "remote_llada.py", "modeling_tiny_llada")


def llada(ignores_mask: bool, dtype=torch.float64):
    config = STAND_IN.TinyLLaDAConfig(vocab_size=len(TOKENIZER), mask_token_id=MASK, pad_token_id=PAD,
                                      eos_token_id=TOKENIZER.eos_token_id, ignores_attention_mask=ignores_mask)
    torch.manual_seed(1)
    return STAND_IN.TinyLLaDAModelLM(config).to(dtype).eval()


def prompt_batch(rows=None):
    prompts = [TOKENIZER(p)["input_ids"] for p in PROMPTS]
    rows = range(len(prompts)) if rows is None else rows
    return left_pad_tensors([prompts[row] for row in rows], PAD, "cpu")[:2]


def estimate(model, rows, row_chunk, attended):
    prompt_ids, prompt_mask = prompt_batch(rows)
    generator = torch.Generator().manual_seed(0)
    completions = torch.randint(3, 40, (len(PROMPTS), 6), generator=generator)[rows]
    completion_mask = torch.ones_like(completions)
    seeds = rollout_mask_seeds(0, 0, range(len(PROMPTS)), 1)[rows, 0]
    spec = EstimatorSpec(mask_token_id=MASK, pad_token_id=PAD, completion_slots=SLOTS, p_mask_prompt=0.3,
                         padding_style="bias4d", attends_to_padding=attended)
    return masked_logprobs(model, prompt_ids, prompt_mask, completions, completion_mask, seeds, spec,
                           row_chunk=row_chunk)


def test_the_probe_finds_a_model_that_attends_to_padding():
    assert attends_to_padding(llada(True), "bias4d", MASK, PAD)
    assert not attends_to_padding(llada(False), "bias4d", MASK, PAD)
    assert not attends_to_padding(build_tiny_diffusion_model(TOKENIZER), "mask2d", MASK, PAD)
    assert not attends_to_padding(build_tiny_diffusion_model(TOKENIZER, dtype=torch.bfloat16), "mask2d", MASK, PAD)


def test_the_probe_is_not_fooled_by_dropout_and_keeps_the_training_mode():
    model = build_tiny_diffusion_model(TOKENIZER).train()
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.5
    assert not attends_to_padding(model, "mask2d", MASK, PAD)
    assert model.training
    assert not attends_to_padding(llada(False), "bias4d", MASK, MASK)  # pad and mask the same id: another filler
    assert attends_to_padding(llada(True), "bias4d", MASK, MASK)


def test_stand_in_attends_to_padding_when_the_batch_is_padded():
    """Guards the tests below: scored in padded chunks, the released-code stand-in's rows depend on their chunk."""
    model = llada(True)
    everything = list(range(len(PROMPTS)))
    together = estimate(model, everything, None, attended=False)
    alone = torch.cat([estimate(model, [row], None, attended=False) for row in everything])
    assert (together - alone).abs().max() > 1e-3


@pytest.mark.parametrize("row_chunk", [None, 1, 2, 3])
def test_each_row_gets_its_alone_logprobs_in_any_chunk_and_order(row_chunk):
    model = llada(True)
    spec_attended = attends_to_padding(model, "bias4d", MASK, PAD)
    everything = list(range(len(PROMPTS)))
    alone = torch.cat([estimate(model, [row], None, spec_attended) for row in everything])
    for order in (everything, [5, 1, 6, 0, 3, 2, 4]):
        chunked = estimate(model, order, row_chunk, spec_attended)
        torch.testing.assert_close(chunked, alone[order], rtol=0, atol=1e-12)


def test_gradients_flow_back_to_the_rows_in_their_order():
    model = llada(True)
    rows = [5, 1, 6, 0]
    logp = estimate(model, rows, 2, True)
    weights = torch.arange(1.0, 1 + logp.numel(), dtype=logp.dtype).view_as(logp)
    (logp * weights).sum().backward()
    grouped = torch.cat([p.grad.flatten() for p in model.parameters()])
    model.zero_grad()
    per_row = sum((estimate(model, [row], None, True) * weights[i]).sum() for i, row in enumerate(rows))
    per_row.backward()
    torch.testing.assert_close(grouped, torch.cat([p.grad.flatten() for p in model.parameters()]),
                               rtol=1e-9, atol=1e-12)


def sample(model, rows, chunk_size, attended):
    prompts = [TOKENIZER(PROMPTS[row])["input_ids"] for row in rows]
    sampler = DiffusionSampler(block_length=4, steps=8, mask_token_id=MASK, padding_style="bias4d",
                               attends_to_padding=attended)
    config = GenerationConfig(max_new_tokens=SLOTS, do_sample=False)
    return sampler.generate(model, prompts, generation_config=config, chunk_size=chunk_size, pad_token_id=PAD,
                            eos_token_ids=[])


def test_sampling_never_attends_to_padding():
    model = llada(True)
    everything = list(range(len(PROMPTS)))
    forwards = []
    model.register_forward_hook(lambda m, args, kwargs, out: forwards.append(kwargs), with_kwargs=True)
    alone = [sample(model, [row], 1, True)[0] for row in everything]
    forwards.clear()
    for chunk_size in (2, 3, 7):
        assert sample(model, everything, chunk_size, True) == alone
    assert forwards and all(kwargs.get("attention_bias") is None for kwargs in forwards)  # no batch was padded
    assert sample(model, everything, 7, False) != alone  # padded chunks: the stand-in sees the padding


def count_a_reward(completions, **kwargs):
    return [text.count("a") / 4 for text in completions]


@pytest.mark.parametrize("ignores_mask", [True, False])
def test_trainer_probes_once_and_old_logprobs_match_the_loss_at_iteration_zero(tmp_path, ignores_mask):
    """Old log-probs are computed in rollout order, chunks of 4; the loss sees another order: the same numbers."""
    config = DiffuGRPOConfig(
        output_dir=str(tmp_path), report_to=[], use_cpu=True, max_steps=1, per_device_train_batch_size=4,
        num_generations=4, max_completion_length=SLOTS, block_length=4, diffusion_steps=4, num_iterations=2,
        save_strategy="no", seed=3, disable_tqdm=True, activation_checkpointing=False, p_mask_prompt=0.3, beta=0.0,
    )
    trainer = DiffuGRPOTrainer(model=llada(ignores_mask, torch.float32), reward_funcs=count_a_reward, args=config,
                               train_dataset=Dataset.from_dict({"prompt": PROMPTS[:4] * 4}),
                               processing_class=TOKENIZER)
    trainer.model.train()  # a training rollout: old log-probs for the mu = 2 seeds
    rollout = trainer._generate_and_score_completions([{"prompt": p} for p in PROMPTS[:2] + PROMPTS[2:4] * 3])
    shuffled = [3, 0, 5, 1]  # no 6-token prompt: less padding than in the rollout's chunks
    batch = {key: rollout[key][shuffled] for key in ("prompt_ids", "prompt_mask", "completion_ids",
                                                      "completion_mask")}
    with torch.no_grad():
        again = trainer._estimate(trainer.model, batch, rollout["mask_seeds"][shuffled, 0], 4, False)[0]
    torch.testing.assert_close(again, rollout["diffu_old_logps"][shuffled, 0], rtol=0, atol=1e-6)
    assert trainer.estimator.attends_to_padding is ignores_mask
    assert trainer.decisions.backend.attends_to_padding is ignores_mask


def test_every_rank_runs_as_many_forwards_as_the_busiest(monkeypatch):
    """Grouping by length gives each rank its own number of forwards; where forwards are collective (ZeRO-3, DDP's
    buffer broadcast) the others run idle ones, weighted 0: same numbers, same gradients, more forwards."""
    from hf_grpo.diffusion import logprobs, sampler

    model = llada(True)
    rows = [5, 1, 6, 0]
    logp = estimate(model, rows, 2, True)
    (logp.sum()).backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters()])
    model.zero_grad()
    forwards = []
    model.register_forward_hook(lambda *args: forwards.append(1))
    monkeypatch.setattr(logprobs, "max_over_ranks", lambda count: count + 2)  # a busier rank exists
    padded_logp = estimate(model, rows, 2, True)
    padded_logp.sum().backward()
    assert len(forwards) == 4 + 2  # groups of lengths 6, 2, 1, 3 (one row each at most 2), then 2 idle forwards
    torch.testing.assert_close(padded_logp, logp, rtol=0, atol=0)
    torch.testing.assert_close(torch.cat([p.grad.flatten() for p in model.parameters()]), grads, rtol=0, atol=0)

    alone = sample(model, list(range(len(PROMPTS))), 3, True)
    monkeypatch.setattr(sampler, "is_zero3_partitioned", lambda model: True)
    monkeypatch.setattr(sampler, "max_over_ranks", lambda count: count + 1)
    forwards.clear()
    assert sample(model, list(range(len(PROMPTS))), 3, True) == alone
    assert len(forwards) == (4 + 1) * 8  # lengths 3, 2, 6, 1: 4 chunks, then 1 idle chunk; 8 steps each
