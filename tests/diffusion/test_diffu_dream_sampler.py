"""Dream's own sampler equals Dream's ``diffusion_generate`` written out plainly, handed the same noise.

The plain algorithm below follows Dream's published generation code: a left-padded batch with a 2-D mask and
positions from its cumulative sum, shifted logits over the whole row, ``mask_logits = logits[x == mask]``,
tempered then top-p then top-k truncated probabilities, the confidence of the algorithm, ``n = int(m (1 - s/t))``
with ``m`` the mean masked count in float32 and ``t = linspace(1, eps, steps + 1)``, a top-k over the whole
row (or ``alg_temp`` draws). Its two random draws are written as the Gumbel forms this sampler uses (the same
distributions): a categorical draw as ``argmax(log p + G)``, ``multinomial`` without replacement as
``topk(log softmax(conf / alg_temp) + G)``; both sides get the same uniforms. float64 model: no near-tie decides.
"""

import pytest
import torch
import torch.nn.functional as F
from transformers import GenerationConfig
from tests.diffusion.float64_rows import TOKENIZER, model, prompts  # noqa: F401 (model: a fixture)

from hf_grpo.diffusion import dream_sampler, sampler as sampler_module
from hf_grpo.diffusion import draws as draws_module
from hf_grpo.diffusion.config import DiffuGRPOConfig
from hf_grpo.diffusion.dream_sampler import dream_commit_count, dream_generate, dream_timesteps
from hf_grpo.diffusion.model import left_pad_tensors
from hf_grpo.diffusion.sampler import DiffusionSampler, resolve_sampler
from hf_grpo.recipe_support.diffusion_tiny import build_tiny_diffusion_model

MASK, PAD = TOKENIZER.mask_token_id, TOKENIZER.pad_token_id
GEN, STEPS, EPS = 12, 5, 1e-3


def gumbel(uniform):
    return -torch.log(-torch.log(uniform))


def plain_top_p(logits, top_p):
    ordered, order = torch.sort(logits, descending=True)
    cumulative = torch.cumsum(F.softmax(ordered, dim=-1), dim=-1)
    remove = cumulative > top_p
    remove[..., 1:] = remove[..., :-1].clone()
    remove[..., 0] = False
    mask = torch.zeros_like(logits, dtype=torch.bool).scatter_(-1, order, remove)
    return logits.masked_fill(mask, torch.finfo(logits.dtype).min)


def plain_top_k(logits, top_k):
    remove = logits < torch.topk(logits, min(top_k, logits.size(-1)))[0][..., -1, None]
    return logits.masked_fill(remove, torch.finfo(logits.dtype).min)


def plain_dream(model, ids, mask, padded, *, temperature, top_p, top_k, alg, alg_temp, noise):
    rows, width = ids.shape
    x = F.pad(ids, (0, GEN), value=MASK)
    attention = positions = None
    if padded:
        attention = F.pad(mask, (0, GEN), value=1)
        positions = (attention.cumsum(-1) - 1).masked_fill(attention == 0, 1)
    timesteps = torch.linspace(1, EPS, STEPS + 1)
    for i in range(STEPS):
        mask_index = x == MASK
        logits = model(x, attention_mask=attention, position_ids=positions).logits
        logits = torch.cat([logits[:, :1], logits[:, :-1]], dim=1)
        mask_logits = logits[mask_index].clone()
        mask_logits[:, MASK] = float("-inf")  # forbid_mask_token (on by default)
        t, s = timesteps[i], timesteps[i + 1]
        if temperature > 0:
            mask_logits = mask_logits / temperature
        if top_p is not None and top_p < 1:
            mask_logits = plain_top_p(mask_logits, top_p)
        if top_k is not None:
            mask_logits = plain_top_k(mask_logits, top_k)
        probs = torch.softmax(mask_logits, dim=-1)
        if temperature > 0:
            x0 = torch.argmax(torch.log(probs) + gumbel(noise.tokens[i][mask_index[:, width:]]), dim=-1)
            confidence = torch.gather(probs, -1, x0.unsqueeze(-1)).squeeze(-1)
        else:
            confidence, x0 = probs.max(dim=-1)
        if alg == "topk_margin":
            top = torch.sort(probs, dim=-1, descending=True)[0]
            confidence = top[:, 0] - top[:, 1]
        if alg == "entropy":
            confidence = torch.sum(probs * torch.log(probs + 1e-10), dim=-1)
        num_mask_token = mask_index.sum() / mask_index.shape[0]
        n = int(num_mask_token * (1 - s / t)) if i < STEPS - 1 else int(num_mask_token)
        full_confidence = torch.full_like(x, float("-inf"), dtype=logits.dtype)
        full_confidence[mask_index] = confidence
        if n > 0:
            if not alg_temp:
                _, transfer = torch.topk(full_confidence, n)
            else:
                scores = F.log_softmax(full_confidence / alg_temp, dim=-1)
                scores[:, width:] += gumbel(noise.positions[i])
                _, transfer = torch.topk(scores, n)
            x_ = torch.full_like(x, MASK)
            x_[mask_index] = x0
            row_index = torch.arange(rows).unsqueeze(1).expand_as(transfer)
            x[row_index, transfer] = x_[row_index, transfer]
    return x[:, width:]


class SharedNoise:
    """Uniforms per step for every (row, slot, token) and every (row, slot), served in this sampler's order."""

    def __init__(self, rows, vocab, seed=0):
        generator = torch.Generator().manual_seed(seed)
        self.tokens = [torch.rand(rows, GEN, vocab, dtype=torch.float64, generator=generator) for _ in range(STEPS)]
        self.positions = [torch.rand(rows, GEN, dtype=torch.float64, generator=generator) for _ in range(STEPS)]
        self.rows, self.vocab = rows, vocab
        self.token_rows = self.position_calls = 0

    def ours(self, shape, device, generator=None):
        if tuple(shape) == (self.rows, GEN):  # the positions of one step
            uniform = self.positions[self.position_calls]
            self.position_calls += 1
            return gumbel(uniform)
        count, vocab = shape
        assert vocab == self.vocab
        step, begin = divmod(self.token_rows, self.rows * GEN)
        self.token_rows += count
        return gumbel(self.tokens[step].reshape(-1, vocab)[begin:begin + count])


CASES = [  # (algorithm, temperature, top_p, top_k, alg_temp)
    ("maskgit_plus", 0.8, None, None, 0.0),
    ("topk_margin", 0.8, 0.9, None, 0.0),
    ("entropy", 0.8, None, 20, 0.0),
    ("entropy", 1.5, 0.8, 10, 0.5),
    ("maskgit_plus", 0.0, None, None, 0.0),
    ("topk_margin", 0.0, 0.9, 5, 0.7),
]


@pytest.mark.parametrize("padded", [False, True], ids=["equal_lengths", "padded"])
@pytest.mark.parametrize("alg, temperature, top_p, top_k, alg_temp", CASES)
def test_dream_sampler_commits_what_dreams_algorithm_commits(model, monkeypatch, padded, alg, temperature, top_p,
                                                             top_k, alg_temp):
    ids, mask, has_padding = left_pad_tensors(prompts(padded), PAD, "cpu")
    noise = SharedNoise(ids.size(0), model.config.vocab_size)
    with torch.no_grad():
        plain = plain_dream(model, ids, mask, has_padding, temperature=temperature, top_p=top_p, top_k=top_k,
                            alg=alg, alg_temp=alg_temp, noise=noise)
    monkeypatch.setattr(draws_module, "gumbel_noise", noise.ours)
    ours = dream_generate(model, ids, mask, gen_length=GEN, steps=STEPS, mask_token_id=MASK, pad_token_id=PAD,
                          temperature=temperature, top_p=top_p, top_k=top_k, algorithm=alg,
                          confidence_temperature=alg_temp, eps=EPS, logits_shift=True, padding_style="mask2d",
                          has_padding=has_padding)
    assert ours.tolist() == plain.tolist()
    assert not (ours == MASK).any()
    if temperature > 0:
        assert noise.token_rows == STEPS * ids.size(0) * GEN  # every step drew for every slot
    assert noise.position_calls == (STEPS if alg_temp else 0)


def test_the_noise_and_the_algorithm_decide_the_tokens(model):
    """Guards the test above: other uniforms, or another confidence, commit other tokens."""
    ids, mask, padded = left_pad_tensors(prompts(False), PAD, "cpu")
    outputs = set()
    for seed, alg in ((0, "entropy"), (1, "entropy"), (0, "maskgit_plus")):
        noise = SharedNoise(ids.size(0), model.config.vocab_size, seed=seed)
        with torch.no_grad():
            outputs.add(str(plain_dream(model, ids, mask, padded, temperature=0.8, top_p=None, top_k=None, alg=alg,
                                        alg_temp=0.0, noise=noise).tolist()))
    assert len(outputs) == 3


def test_schedule_counts_are_dreams():
    """int(m (1 - s/t)) in float32 with t = linspace(1, eps, steps + 1); the last step takes all that remain."""
    timesteps = dream_timesteps(4, 1e-3)
    masked, counts = 16, []
    for step in range(4):
        counts.append(dream_commit_count(masked * 3, 3, step, timesteps))  # 3 rows of `masked` masks each
        masked -= counts[-1]
    # t = 1, .75025, .5005, .25075: 16 x .24975 = 3.996 -> 3; 13 x .33289 -> 4; 9 x .49900 -> 4; the last 5
    assert counts == [3, 4, 4, 5]


def test_backend_passes_top_p_and_top_k_to_dreams_sampler(model, monkeypatch):
    seen = {}

    def spy(*args, **kwargs):
        seen.update(vars(args[3]))  # the SamplingSettings
        return torch.full((len(args[1]), GEN), 5)

    monkeypatch.setattr(dream_sampler, "dream_generate", spy)
    backend = DiffusionSampler(block_length=GEN, steps=STEPS, mask_token_id=MASK, logits_shift=True,
                               algorithm="dream", confidence_algorithm="topk_margin", confidence_temperature=0.3,
                               schedule_eps=0.01, forbid_mask_token=False)
    config = GenerationConfig(max_new_tokens=GEN, do_sample=True, temperature=0.7, top_p=0.9, top_k=7)
    backend.generate(model, prompts(True), generation_config=config, chunk_size=4, pad_token_id=PAD, eos_token_ids=[])
    assert {k: seen[k] for k in ("temperature", "top_p", "top_k", "confidence_algorithm", "confidence_temperature",
                                 "schedule_eps", "forbid_mask_token")} == dict(
        temperature=0.7, top_p=0.9, top_k=7, confidence_algorithm="topk_margin", confidence_temperature=0.3,
        schedule_eps=0.01, forbid_mask_token=False)


def test_sampler_is_chosen_by_model_family(tmp_path, model):
    config = DiffuGRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    assert resolve_sampler(config, model) == "llada"
    dream_like = build_tiny_diffusion_model(TOKENIZER)
    dream_like.config.model_type = "dream"
    assert resolve_sampler(config, dream_like) == "dream"
    assert resolve_sampler(DiffuGRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to=[], sampler="llada"),
                           dream_like) == "llada"
    with pytest.raises(ValueError, match="block_cache='dual'.*need sampler='llada'"):
        resolve_sampler(DiffuGRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to=[], block_cache="dual"),
                        dream_like)
    with pytest.raises(ValueError, match="confidence_algorithm must be one of"):
        DiffuGRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to=[], confidence_algorithm="origin")
    with pytest.raises(ValueError, match="sampler must be one of"):
        DiffuGRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to=[], sampler="mdlm")


def count_a_reward(completions, **kwargs):
    return [text.count("a") / 4 for text in completions]


def test_trainer_samples_with_dreams_sampler(tmp_path, monkeypatch):
    from datasets import Dataset

    from hf_grpo.diffusion import DiffuGRPOTrainer

    calls = []
    original = dream_sampler.dream_generate
    monkeypatch.setattr(dream_sampler, "dream_generate", lambda *a, **k: calls.append(a[3]) or original(*a, **k))
    config = DiffuGRPOConfig(
        output_dir=str(tmp_path), report_to=[], use_cpu=True, max_steps=1, per_device_train_batch_size=4,
        num_generations=4, max_completion_length=8, block_length=8, diffusion_steps=4, save_strategy="no", seed=3,
        disable_tqdm=True, activation_checkpointing=False, beta=0.0, sampler="dream", logits_shift=True,
        confidence_algorithm="maskgit_plus", top_k=5,
    )
    trainer = DiffuGRPOTrainer(model=build_tiny_diffusion_model(TOKENIZER), reward_funcs=count_a_reward, args=config,
                               train_dataset=Dataset.from_dict({"prompt": ["ab>", "cde>"] * 4}),
                               processing_class=TOKENIZER)
    trainer.train()
    assert trainer.decisions.backend.algorithm == "dream" and calls
    assert calls[0].confidence_algorithm == "maskgit_plus" and calls[0].top_k == 5 and calls[0].steps == 4
    assert trainer.args.diffusion_plan(1).startswith(
        "diffusion: Dream's sampler: 8 tokens, 4 steps, no blocks, schedule linspace(1, 0.001), "
        "maskgit_plus confidence")


def mask_loving_model():
    """A tiny model whose head puts a large bias on the mask token: an untrained model's worst case."""
    model = build_tiny_diffusion_model(TOKENIZER, seed=1, dtype=torch.float64).eval()
    head = torch.nn.Linear(model.lm_head.in_features, model.lm_head.out_features, bias=True, dtype=torch.float64)
    with torch.no_grad():
        head.weight.copy_(model.lm_head.weight)
        head.bias.zero_()
        head.bias[MASK] = 50.0
    model.lm_head = head
    return model


@pytest.mark.parametrize("which", ["llada", "dream"])
def test_forbid_mask_token_switch(which):
    """On (default): no completion holds the mask token. Off (the published samplers): the draw can pick it."""
    model = mask_loving_model()
    ids, mask, padded = left_pad_tensors(prompts(True), PAD, "cpu")
    outputs = {}
    for forbid in (True, False):
        if which == "llada":
            outputs[forbid] = sampler_module.diffusion_generate(
                model, ids, mask, gen_length=GEN, block_length=4, steps=6, mask_token_id=MASK, pad_token_id=PAD,
                has_padding=padded, forbid_mask_token=forbid)
        else:
            outputs[forbid] = dream_generate(model, ids, mask, gen_length=GEN, steps=STEPS, mask_token_id=MASK,
                                             pad_token_id=PAD, has_padding=padded, forbid_mask_token=forbid)
    assert not (outputs[True] == MASK).any()
    assert (outputs[False] == MASK).any()


def test_forbid_mask_token_defaults_on_and_reaches_the_backend(tmp_path):
    assert DiffuGRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to=[]).forbid_mask_token is True
    assert DiffusionSampler(block_length=4, steps=4, mask_token_id=MASK).forbid_mask_token is True
