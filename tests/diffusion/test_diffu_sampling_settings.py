"""SamplingSettings: one object for both samplers and the backend; the old keyword arguments still work."""

import pytest
import torch
from transformers import GenerationConfig

from hf_grpo.diffusion.dream_sampler import dream_generate
from hf_grpo.diffusion.model import left_pad_tensors
from hf_grpo.diffusion.sampler import DiffusionSampler, diffusion_generate
from hf_grpo.diffusion.sampling_settings import SamplingSettings
from hf_grpo.recipe_support.diffusion_tiny import build_diffusion_tokenizer, build_tiny_diffusion_model

TOKENIZER = build_diffusion_tokenizer()
MASK, PAD = TOKENIZER.mask_token_id, TOKENIZER.pad_token_id
IDS = [TOKENIZER(p)["input_ids"] for p in ["ab>", "c>", "defgh>", "h>"]]


@pytest.fixture(scope="module")
def model():
    return build_tiny_diffusion_model(TOKENIZER, seed=2).eval()


def padded():
    ids, mask, has_padding = left_pad_tensors(IDS, PAD, "cpu")
    return ids, mask, dict(mask_token_id=MASK, pad_token_id=PAD, has_padding=has_padding)


def seeded():
    return torch.Generator().manual_seed(7)


def test_llada_sampler_draws_the_same_tokens_from_settings_or_keywords(model):
    ids, mask, common = padded()
    settings = SamplingSettings(steps=6, block_length=4, temperature=0.8, remasking="random", cfg_scale=1.0)
    from_settings = diffusion_generate(model, ids, mask, settings, gen_length=12, generator=seeded(), **common)
    from_keywords = diffusion_generate(model, ids, mask, gen_length=12, steps=6, block_length=4, temperature=0.8,
                                       remasking="random", cfg_scale=1.0, generator=seeded(), **common)
    assert torch.equal(from_settings, from_keywords)
    # a keyword beside the settings replaces that one setting
    greedy = diffusion_generate(model, ids, mask, settings, gen_length=12, temperature=0.0, remasking="low_confidence",
                                cfg_scale=0.0, **common)
    assert torch.equal(greedy, diffusion_generate(model, ids, mask, SamplingSettings(steps=6, block_length=4),
                                                  gen_length=12, **common))


def test_dream_sampler_takes_its_old_names_for_the_confidence_algorithm_and_the_schedule(model):
    ids, mask, common = padded()
    settings = SamplingSettings(steps=5, temperature=0.9, top_k=6, confidence_algorithm="topk_margin",
                                confidence_temperature=0.5, schedule_eps=0.01, sampler="dream")
    from_settings = dream_generate(model, ids, mask, settings, gen_length=10, generator=seeded(), **common)
    from_keywords = dream_generate(model, ids, mask, gen_length=10, steps=5, temperature=0.9, top_k=6,
                                   algorithm="topk_margin", confidence_temperature=0.5, eps=0.01, generator=seeded(),
                                   **common)
    assert torch.equal(from_settings, from_keywords) and not (from_settings == MASK).any()


def test_the_backend_takes_settings_or_its_old_keywords():
    config = GenerationConfig(max_new_tokens=8, do_sample=False)
    model = build_tiny_diffusion_model(TOKENIZER, seed=3).eval()
    old = DiffusionSampler(block_length=4, steps=4, mask_token_id=MASK, algorithm="llada", remasking="random")
    new = DiffusionSampler(SamplingSettings(steps=4, block_length=4, remasking="random"), mask_token_id=MASK)
    assert old.settings == new.settings and old.algorithm == "llada" and old.block_cache is None
    outputs = []
    for sampler in (old, new):
        torch.manual_seed(0)  # random remasking draws from the global generator
        outputs.append(sampler.generate(model, IDS, generation_config=config, chunk_size=2, pad_token_id=PAD,
                                        eos_token_ids=[]))
    assert outputs[0] == outputs[1]


def test_an_unknown_keyword_names_the_settings():
    ids, mask, common = padded()
    with pytest.raises(TypeError, match=r"diffusion_generate\(\) got an unexpected keyword argument 'step'; .*'steps'"):
        diffusion_generate(None, ids, mask, gen_length=8, step=4, block_length=4, **common)
    with pytest.raises(TypeError, match=r"DiffusionSampler\(\) needs settings=SamplingSettings\(steps=...\)"):
        DiffusionSampler(block_length=4, mask_token_id=MASK)


@pytest.mark.parametrize("values, message", [
    (dict(remasking="lowest"), r"remasking must be one of \('low_confidence', 'random'\), got 'lowest'"),
    (dict(sampler="mdlm"), r"sampler must be one of \('llada', 'dream'\), got 'mdlm'"),
    (dict(confidence_algorithm="margin"), r"confidence algorithm must be one of .*got 'margin'"),
    (dict(sampler="dream", cfg_scale=1.0), r"Dream's sampler has no blocks, guidance or remasking choice: .*"
                                           r"cfg_scale=1.0 .*need sampler='llada'"),
])
def test_a_bad_setting_is_refused_when_the_settings_are_built(values, message):
    with pytest.raises(ValueError, match=message):
        SamplingSettings(steps=4, **values)
