"""The masked log-prob estimate: exact under any chunking, seeded per row (never the global RNG), both estimators."""

import pytest
import torch

from hf_grpo.diffusion.logprobs import EstimatorSpec, mask_seed, masked_logprobs, rollout_mask_seeds
from hf_grpo.diffusion.model import left_pad_tensors
from hf_grpo.recipe_support.diffusion_tiny import build_diffusion_tokenizer, build_tiny_diffusion_model

TOKENIZER = build_diffusion_tokenizer()
MASK = TOKENIZER.mask_token_id
PROMPTS = ["ab>", "c>", "defgh>", "h>", "ij>", "klmno>"]
SLOTS = 8


@pytest.fixture(scope="module")
def batch():
    torch.manual_seed(0)
    prompt_ids, prompt_mask, _ = left_pad_tensors([TOKENIZER(p)["input_ids"] for p in PROMPTS], 0, "cpu")
    completion_ids = torch.randint(3, 40, (len(PROMPTS), 6))
    completion_mask = torch.ones_like(completion_ids)
    completion_mask[1, 3:] = 0  # completions of different lengths, right-padded as TRL pads them
    completion_mask[4, 1:] = 0
    seeds = rollout_mask_seeds(0, 0, range(len(PROMPTS)), 3)
    return prompt_ids, prompt_mask, completion_ids, completion_mask, seeds


@pytest.fixture(scope="module")
def model():
    return build_tiny_diffusion_model(TOKENIZER, seed=2).eval()


def spec(**kwargs):
    values = dict(mask_token_id=MASK, pad_token_id=0, completion_slots=SLOTS, p_mask_prompt=0.5)
    values.update(kwargs)
    return EstimatorSpec(**values)


@pytest.mark.parametrize("estimator", ["mean_field", "coupled"])
@pytest.mark.parametrize("shift", [False, True])
def test_estimate_is_identical_for_any_row_and_token_chunking(model, batch, estimator, shift):
    prompt_ids, prompt_mask, completion_ids, completion_mask, seeds = batch
    args = (model, prompt_ids, prompt_mask, completion_ids, completion_mask, seeds[:, 1])
    reference, reference_entropy = masked_logprobs(*args, spec(estimator=estimator, logits_shift=shift),
                                                   return_entropy=True)
    rng = torch.get_rng_state()
    for rows in (1, 4):
        for tokens in (1, 5):
            logp, entropy = masked_logprobs(*args, spec(estimator=estimator, logits_shift=shift,
                                                        tensor_batch_size=tokens), row_chunk=rows,
                                            return_entropy=True)
            torch.testing.assert_close(logp, reference, rtol=0, atol=1e-5)
            torch.testing.assert_close(entropy, reference_entropy, rtol=0, atol=1e-5)
    assert torch.equal(rng, torch.get_rng_state()), "the estimate drew from the global RNG"
    assert (reference[completion_mask.bool()] < 0).all() and (reference[~completion_mask.bool()] == 0).all()


def test_a_rows_estimate_does_not_depend_on_its_neighbours(model, batch):
    """The same rows split over two 'ranks' (other neighbours, other padding) give the same numbers."""
    prompt_ids, prompt_mask, completion_ids, completion_mask, seeds = batch
    whole = masked_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask, seeds[:, 0], spec())
    for part in (slice(0, 3), slice(3, 6), slice(2, 3)):
        alone = masked_logprobs(model, prompt_ids[part], prompt_mask[part], completion_ids[part],
                                completion_mask[part], seeds[part, 0], spec())
        torch.testing.assert_close(alone, whole[part], rtol=0, atol=1e-5)


def test_gradients_are_identical_for_any_chunking(batch):
    prompt_ids, prompt_mask, completion_ids, completion_mask, seeds = batch
    grads = []
    for rows, tokens in ((None, None), (2, 3), (1, 1)):
        model = build_tiny_diffusion_model(TOKENIZER, seed=2)
        logp = masked_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask, seeds[:, 2],
                               spec(tensor_batch_size=tokens, estimator="coupled"), row_chunk=rows)
        (logp * completion_mask).sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    for other in grads[1:]:
        assert ((other - grads[0]).norm() / grads[0].norm()).item() < 1e-5


def test_seeds_differ_by_iteration_row_and_rollout_and_change_the_estimate(model, batch):
    prompt_ids, prompt_mask, completion_ids, completion_mask, seeds = batch
    assert seeds.shape == (6, 3) and len(set(seeds.flatten().tolist())) == 18
    assert mask_seed(0, 0, 1, 4) == seeds[4, 1] and mask_seed(0, 1, 1, 4) != seeds[4, 1]
    estimates = [masked_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask, seeds[:, k], spec())
                 for k in range(3)]
    assert not torch.allclose(estimates[0], estimates[1]) and not torch.allclose(estimates[1], estimates[2])
    again = masked_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask, seeds[:, 1], spec())
    assert torch.equal(again, estimates[1])  # the same seed, the same masks


def test_mean_field_masks_every_completion_slot(model, batch):
    """With no prompt masking the estimate is log_softmax of one forward over [prompt | L masks]."""
    prompt_ids, prompt_mask, completion_ids, completion_mask, seeds = batch
    logp = masked_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask, seeds[:, 0],
                           spec(p_mask_prompt=0.0))
    for row, prompt in enumerate(PROMPTS):
        ids = torch.tensor([TOKENIZER(prompt)["input_ids"] + [MASK] * SLOTS])
        with torch.no_grad():
            logits = model(ids).logits[0, -SLOTS:][: completion_ids.size(1)]
        manual = logits.log_softmax(-1).gather(-1, completion_ids[row, :, None]).squeeze(-1)
        keep = completion_mask[row].bool()
        torch.testing.assert_close(logp[row][keep], manual[keep], rtol=0, atol=1e-5)


def test_coupled_scores_every_token_once_from_the_forward_that_hides_it(model, batch):
    prompt_ids, prompt_mask, completion_ids, completion_mask, seeds = batch
    s = spec(estimator="coupled", p_mask_prompt=0.0)
    logp = masked_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask, seeds[:, 0], s)
    generator = torch.Generator().manual_seed(int(seeds[0, 0]))  # row 0: redo its draw by hand
    ratio = 0.2 + 0.6 * torch.rand((), generator=generator)
    hidden_first = torch.rand(SLOTS, generator=generator) < ratio
    prompt = TOKENIZER(PROMPTS[0])["input_ids"]
    manual = torch.zeros(completion_ids.size(1))
    for hidden in (hidden_first, ~hidden_first):
        slots = torch.where(hidden[:6], torch.full((6,), MASK), completion_ids[0])
        ids = torch.tensor([prompt + slots.tolist() + [MASK] * (SLOTS - 6)])
        with torch.no_grad():
            logits = model(ids).logits[0, len(prompt):len(prompt) + 6]
        values = logits.log_softmax(-1).gather(-1, completion_ids[0, :, None]).squeeze(-1)
        manual = manual + torch.where(hidden[:6], values, torch.zeros(6))
    torch.testing.assert_close(logp[0], manual, rtol=0, atol=1e-5)
