"""The default sampler is an exact speed-up of the plain published algorithm (LLaDA's ``generate``).

The plain algorithm is the one the GPU benchmark times (``bench/diffu_llada.py``): full-vocabulary logits at
every position, Gumbel noise ``exp(l) / (-log u)^T`` and the softmax in float64 over the whole row, a top-k
per row. hf_grpo's sampler projects only the current block, draws Gumbel noise ``-log(-log u)`` for the
block only and ranks by ``log_softmax``. Handed the same uniforms for the block (the plain algorithm's
noise elsewhere never matters: those positions are not committed), both commit the same tokens at the
same steps. float64 model, so no near-tie decides anything.
"""

import pytest
import torch
from tests.project_files import load_bench
from tests.diffusion.float64_rows import TOKENIZER, model, prompts  # noqa: F401 (model: a fixture)

from hf_grpo.diffusion import sampler as sampler_module
import hf_grpo.diffusion.draws as draws_module
from hf_grpo.diffusion.model import left_pad_tensors
from hf_grpo.diffusion.sampler import diffusion_generate
from hf_grpo.recipe_support.diffusion_tiny import build_tiny_diffusion_model

MASK = TOKENIZER.mask_token_id
GEN, BLOCK, STEPS = 12, 4, 6  # 3 blocks, 2 steps per block, 2 tokens per step


@pytest.fixture(scope="module")
def bench():
    return load_bench("diffu_llada")


class SharedNoise:
    """Per-step uniforms over the completion slots ``[B, GEN, V]``, served in each sampler's own layout."""

    def __init__(self, rows, vocab, seed=0):
        generator = torch.Generator().manual_seed(seed)
        self.table = [torch.rand(rows, GEN, vocab, dtype=torch.float64, generator=generator) for _ in range(STEPS)]
        self.plain_calls = self.ours_calls = 0

    def plain(self, width):
        def uniform(shape, device):  # [B, width + GEN, V]: the slots get the table, the prompt anything
            full = torch.full(shape, 0.5, dtype=torch.float64)
            full[:, width:] = self.table[self.plain_calls]
            self.plain_calls += 1
            return full

        return uniform

    def ours(self, shape, device, generator=None):  # [B * n, V]: the n slots before the block's end, as Gumbel noise
        step = self.ours_calls
        block = step // (STEPS // (GEN // BLOCK))
        self.ours_calls += 1
        rows, _, vocab = self.table[0].shape
        slots, end = shape[0] // rows, (block + 1) * BLOCK
        assert tuple(shape) == (rows * slots, vocab)  # the tiny vocabulary fits one slice
        uniform = self.table[step][:, end - slots:end].reshape(rows * slots, vocab)
        return -torch.log(-torch.log(uniform))


@pytest.mark.parametrize("padded", [False, True], ids=["equal_lengths", "padded"])
@pytest.mark.parametrize("temperature", [0.0, 0.9, 2.0])
def test_default_sampler_commits_what_the_plain_published_algorithm_commits(bench, model, monkeypatch, padded,
                                                                            temperature):
    ids, mask, has_padding = left_pad_tensors(prompts(padded), TOKENIZER.pad_token_id, "cpu")
    noise = SharedNoise(ids.size(0), model.config.vocab_size)
    plain = bench.plain_generate(model, ids, mask if has_padding else None, steps=STEPS, gen_length=GEN,
                                 block_length=BLOCK, temperature=temperature, mask_id=MASK,
                                 uniform=noise.plain(ids.size(1)))
    monkeypatch.setattr(draws_module, "gumbel_noise", noise.ours)
    ours = diffusion_generate(model, ids, mask, gen_length=GEN, block_length=BLOCK, steps=STEPS, mask_token_id=MASK,
                              pad_token_id=TOKENIZER.pad_token_id, temperature=temperature, has_padding=has_padding)
    assert ours.tolist() == plain.tolist()
    if temperature > 0:  # every step drew noise, and the draws differed between steps (the test is not vacuous)
        assert noise.plain_calls == noise.ours_calls == STEPS
    assert not (ours == MASK).any()


def test_sampled_tokens_depend_on_the_noise(bench, model, monkeypatch):
    """Guards the test above: with other uniforms, the same model commits other tokens."""
    ids = left_pad_tensors(prompts(False), TOKENIZER.pad_token_id, "cpu")[0]
    outputs = []
    for seed in (0, 1):
        noise = SharedNoise(ids.size(0), model.config.vocab_size, seed=seed)
        outputs.append(bench.plain_generate(model, ids, None, steps=STEPS, gen_length=GEN, block_length=BLOCK,
                                            temperature=0.9, mask_id=MASK, uniform=noise.plain(ids.size(1))))
    assert outputs[0].tolist() != outputs[1].tolist()


def test_plain_transfer_counts_match_the_block_schedule(bench):
    block = torch.ones(2, 32, dtype=torch.bool)
    assert bench.plain_transfer_counts(block, 16)[0].tolist() == sampler_module.transfer_schedule(32, 16)
    assert bench.plain_transfer_counts(block[:, :5], 3)[1].tolist() == sampler_module.transfer_schedule(5, 3)


@pytest.mark.slow  # 15-40 s on a 2-core CPU
def test_bench_tiny_run_reports_every_measurement(bench):
    """``python bench/diffu_llada.py --tiny`` (a CPU smoke run of the GPU benchmark) produces every record."""
    records = bench.main(["--tiny", "--caches", "dual", "--gen-batches", "2", "--tensor-batch-sizes", "16",
                          "--iterations", "1"])
    kinds = [(r["what"], r.get("impl")) for r in records]
    assert kinds == [("setup", None), ("rollout", "plain"), ("rollout", "ours"), ("rollout", "ours_cache_dual"),
                     ("score", "plain"), ("score", "ours"), ("train_step", "plain"), ("train_step", "ours"),
                     ("summary", None)]
    assert all(not r.get("oom") for r in records)
    assert records[-1]["rollout"]["ours_cache_dual@g2"]["speedup"] > 0


def mask_leaning_model(bias: float):
    """The test model with a bias towards the mask token in its head: it draws the mask token now and then."""
    leaning = build_tiny_diffusion_model(TOKENIZER, seed=3, dtype=torch.float64).eval()
    head = torch.nn.Linear(leaning.lm_head.in_features, leaning.lm_head.out_features, bias=True, dtype=torch.float64)
    with torch.no_grad():
        head.weight.copy_(leaning.lm_head.weight)
        head.bias.zero_()
        head.bias[MASK] = bias
    leaning.lm_head = head
    return leaning


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_without_forbid_mask_token_the_sampler_is_llada_code_token_for_token(bench, monkeypatch, temperature):
    """forbid_mask_token=False: LLaDA's published sampler, mask-token draws (a slot that draws it stays masked)
    included."""
    model = mask_leaning_model(bias=2.5)
    ids, mask, has_padding = left_pad_tensors(prompts(True), TOKENIZER.pad_token_id, "cpu")
    noise = SharedNoise(ids.size(0), model.config.vocab_size)
    plain = bench.plain_generate(model, ids, mask, steps=STEPS, gen_length=GEN, block_length=BLOCK,
                                 temperature=temperature, mask_id=MASK, uniform=noise.plain(ids.size(1)),
                                 forbid_mask_token=False)
    monkeypatch.setattr(draws_module, "gumbel_noise", noise.ours)
    ours = diffusion_generate(model, ids, mask, gen_length=GEN, block_length=BLOCK, steps=STEPS, mask_token_id=MASK,
                              pad_token_id=TOKENIZER.pad_token_id, temperature=temperature, has_padding=has_padding,
                              forbid_mask_token=False)
    assert ours.tolist() == plain.tolist()
    assert (ours == MASK).any()  # the mask token was drawn: the switch mattered
