"""The CUDA Gumbel-max kernel: argmax and confidence exact, draws from softmax(l / T), seeded, no float64 tensors."""

import math

import pytest
import torch

from hf_grpo.diffusion import gumbel_max as kernel_module
from hf_grpo.diffusion import sampler as sampler_module
from hf_grpo.diffusion.gumbel_max import gumbel_max, usable

cuda = pytest.mark.skipif(not (torch.cuda.is_available() and kernel_module.TRITON), reason="needs CUDA and Triton")


def test_cpu_logits_take_the_torch_path_and_the_kernel_refuses_them_by_name():
    logits = torch.randn(3, 10)
    assert not usable(logits)
    with pytest.raises(ValueError, match=r"gumbel_max needs CUDA logits \[N, V\].*got \(3, 10\) torch.float32 on cpu"):
        gumbel_max(logits, 0.9)
    tokens, _ = sampler_module.sample_tokens(logits, 0.0)  # the sliced torch path
    assert tokens.tolist() == logits.argmax(-1).tolist()


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_greedy_is_argmax_and_confidence_is_the_log_softmax(dtype):
    """Vocabulary not a multiple of the block, ties across and inside blocks (lower id wins), -inf words."""
    generator = torch.Generator(device="cuda").manual_seed(0)
    vocab = 2 * kernel_module.BLOCK + 77
    logits = (torch.randn(37, vocab, device="cuda", generator=generator) * 4).to(dtype)
    logits[0, [5, kernel_module.BLOCK + 5, vocab - 1]] = 30.0  # tie across blocks
    logits[1, [9, 10]] = 30.0  # tie inside a block (and a lane)
    logits[2, : vocab // 2] = float("-inf")
    tokens, confidence = gumbel_max(logits, 0.0)
    assert tokens.tolist() == logits.argmax(-1).tolist()
    assert tokens[0] == 5 and tokens[1] == 9
    expected = logits.double().log_softmax(-1).gather(-1, tokens[:, None]).squeeze(-1).float()
    torch.testing.assert_close(confidence, expected, rtol=0, atol=1e-6)


@pytest.mark.gpu
@cuda
def test_sampling_follows_the_tempered_distribution_down_to_rare_words():
    """200,000 draws over 5 words at T = 0.7, one of them at probability ~2e-3: every frequency within 5 sigma."""
    base = torch.tensor([2.0, 1.0, 0.0, -1.5, -2.0], dtype=torch.float64)
    logits = torch.full((200_000, 4100), float("-inf"), device="cuda")
    words = torch.tensor([3, 700, 2049, 2050, 4099], device="cuda")  # spread over the blocks
    logits[:, words] = base.float().cuda()
    generator = torch.Generator(device="cuda").manual_seed(1)
    tokens, confidence = gumbel_max(logits, 0.7, generator)
    counts = torch.stack([(tokens == w).sum() for w in words]).double().cpu()
    assert counts.sum() == len(tokens)  # a -inf word is never drawn
    expected = torch.softmax(base / 0.7, -1)
    sigma = (expected * (1 - expected) / len(tokens)).sqrt()
    assert expected.min() < 3e-3
    assert ((counts / len(tokens) - expected).abs() <= 5 * sigma).all(), (counts / len(tokens), expected)
    picked = torch.searchsorted(words, tokens)
    untempered = torch.log_softmax(base, -1).float().cuda()
    torch.testing.assert_close(confidence, untempered[picked], rtol=0, atol=1e-6)


@pytest.mark.gpu
@cuda
def test_a_seeded_generator_repeats_its_draws_and_another_seed_does_not():
    logits = torch.zeros(64, 5000, device="cuda", dtype=torch.bfloat16)  # uniform: the noise decides
    draws = []
    for seed in (7, 7, 8):
        generator = torch.Generator(device="cuda").manual_seed(seed)
        draws.append(gumbel_max(logits, 1.0, generator)[0].tolist())
    assert draws[0] == draws[1] != draws[2]
    generator = torch.Generator(device="cuda").manual_seed(7)
    first, second = gumbel_max(logits, 1.0, generator)[0], gumbel_max(logits, 1.0, generator)[0]
    assert first.tolist() != second.tolist()  # the generator advances: each call draws anew
    assert len(set(first.tolist())) > 40  # rows draw independently


@pytest.mark.gpu
@cuda
def test_sampling_holds_no_tensor_the_size_of_the_logits():
    """The torch path's float64 copies of [N, V] are what this replaces: the call adds only its outputs."""
    logits = torch.randn(256, 126_464, device="cuda", dtype=torch.bfloat16)
    generator = torch.Generator(device="cuda").manual_seed(0)
    gumbel_max(logits, 0.9, generator)  # compile first
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    tokens, confidence = sampler_module.sample_tokens(logits.view(8, 32, -1), 0.9, generator)
    torch.cuda.synchronize()
    assert tokens.shape == confidence.shape == (8, 32)
    assert torch.cuda.max_memory_allocated() - before < 1 << 20  # 1 MiB; a float64 [256, V] is 247 MiB
    assert math.isfinite(confidence.sum().item())
