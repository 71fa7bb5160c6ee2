"""The diffusion sampler: commit schedule, no mask left, chunk- and padding-invariance, float64 Gumbel on the block."""

import pytest
import torch
from transformers import GenerationConfig

from hf_grpo.diffusion import sampler as sampler_module
import hf_grpo.diffusion.draws as draws_module
from hf_grpo.diffusion.model import left_pad_tensors
from hf_grpo.diffusion.sampler import DiffusionSampler, commit_topk, diffusion_generate, transfer_schedule
from hf_grpo.recipe_support.diffusion_tiny import build_diffusion_tokenizer, build_tiny_diffusion_model

TOKENIZER = build_diffusion_tokenizer()
MASK = TOKENIZER.mask_token_id
PROMPTS = ["ab>", "c>", "defgh>", "h>", "ij>", "klmno>", "p>"]
IDS = [TOKENIZER(p)["input_ids"] for p in PROMPTS]


@pytest.fixture(scope="module")
def model():
    return build_tiny_diffusion_model(TOKENIZER, seed=1).eval()


def generate(model, prompts, **kwargs):
    ids, mask, padded = left_pad_tensors(prompts, TOKENIZER.pad_token_id, "cpu")
    options = dict(gen_length=12, block_length=4, steps=6, mask_token_id=MASK, pad_token_id=TOKENIZER.pad_token_id,
                   has_padding=padded)
    options.update(kwargs)
    return diffusion_generate(model, ids, mask, **options)


def test_transfer_schedule_spreads_the_block_over_its_steps():
    assert transfer_schedule(32, 16) == [2] * 16
    assert transfer_schedule(5, 3) == [2, 2, 1]
    assert sum(transfer_schedule(7, 7)) == 7


def test_commit_topk_takes_k_per_row_without_a_loop():
    scores = torch.tensor([[0.1, 0.9, 0.5, -float("inf")], [3.0, 2.0, 1.0, 0.0]])
    chosen = commit_topk(scores, torch.tensor([2, 1]))
    assert chosen.tolist() == [[False, True, True, False], [True, False, False, False]]
    assert commit_topk(scores, torch.tensor([0, 4])).sum(1).tolist() == [0, 4]


@pytest.mark.parametrize("remasking, temperature, cfg", [("low_confidence", 0.0, 0.0), ("low_confidence", 1.0, 0.0),
                                                         ("random", 0.7, 0.0), ("low_confidence", 0.9, 1.5)])
def test_each_step_commits_exactly_the_scheduled_tokens_and_no_mask_is_left(model, remasking, temperature, cfg):
    schedule = transfer_schedule(4, 2)  # 12 tokens, 3 blocks of 4, 6 steps: 2 per step
    seen = []

    def on_step(block, step, canvas, columns):
        seen.append((block, step, int((canvas.gather(1, columns) != MASK).sum(1).min()),
                     int((canvas.gather(1, columns) != MASK).sum(1).max()), int((canvas == MASK).sum())))

    out = generate(model, IDS, temperature=temperature, remasking=remasking, cfg_scale=cfg, step_callback=on_step)
    rows = len(IDS)
    assert len(seen) == 6
    for index, (block, step, low, high, masks_left) in enumerate(seen):
        done = sum(schedule[: step + 1])
        assert low == high == done, (block, step)  # every row: exactly the scheduled count in the block
        assert masks_left == rows * (12 - 4 * block - done)
    assert out.shape == (rows, 12) and not (out == MASK).any()


def test_greedy_output_is_identical_for_any_generation_chunk_size(model):
    sampler = DiffusionSampler(block_length=4, steps=6, mask_token_id=MASK)
    config = GenerationConfig(max_new_tokens=12, do_sample=False, temperature=1.0)
    outputs = [sampler.generate(model, IDS, generation_config=config, chunk_size=chunk, pad_token_id=0,
                                eos_token_ids=[TOKENIZER.eos_token_id]) for chunk in (1, 3, 7)]
    assert outputs[0] == outputs[1] == outputs[2]
    assert sampler.forwards == 6 * (7 + 3 + 1)  # 6 steps per chunk; 7 + 3 + 1 chunks


@pytest.mark.parametrize("shift", [False, True])
@pytest.mark.parametrize("cfg", [0.0, 1.0])
def test_padded_prompt_gets_the_completion_it_gets_alone(model, shift, cfg):
    together = generate(model, IDS, logits_shift=shift, cfg_scale=cfg)  # prompts of 2..6 tokens: padded
    for row, prompt in enumerate(IDS):
        alone = generate(model, [prompt], logits_shift=shift, cfg_scale=cfg)
        assert together[row].tolist() == alone[0].tolist(), PROMPTS[row]


@pytest.mark.parametrize("slice_elements", [None, 120], ids=["whole_vocabulary", "slices_of_10_columns"])
def test_gumbel_noise_is_float64_and_covers_the_current_block_only(model, monkeypatch, slice_elements):
    """Each step draws float64 noise for the block's 3 x 4 positions only, over the whole vocabulary once
    (in one piece, or in slices of NOISE_ELEMENTS // 12 columns)."""
    shapes = []
    original = draws_module.gumbel_noise

    def spy(shape, device, generator=None):
        noise = original(shape, device, generator)
        shapes.append((tuple(shape), noise.dtype))
        return noise

    monkeypatch.setattr(draws_module, "gumbel_noise", spy)
    if slice_elements:
        monkeypatch.setattr(draws_module, "NOISE_ELEMENTS", slice_elements)
    generate(model.to(torch.bfloat16), IDS[:3], temperature=0.9)
    model.to(torch.float32)
    vocab = model.config.vocab_size
    widths = [shape[1] for shape, _ in shapes]
    assert shapes and all(shape[0] == 3 * 4 and dtype == torch.float64 for shape, dtype in shapes)
    per_step = [10] * (vocab // 10) + ([vocab % 10] if vocab % 10 else []) if slice_elements else [vocab]
    assert widths == per_step * 6  # 6 steps, each covering the vocabulary once


class TableNoise:
    """Gumbel noise read from one fixed ``[positions, V]`` table in the order a step asks for it: pieces of rows,
    each a slice of columns per call, left to right; after the last position the next step starts over."""

    def __init__(self, positions, vocab, seed=0):
        self.table = draws_module.gumbel_noise((positions, vocab), "cpu", torch.Generator().manual_seed(seed))
        self.row = self.column = 0

    def __call__(self, shape, device, generator=None):
        rows, width = shape
        piece = self.table[self.row:self.row + rows, self.column:self.column + width].clone()
        assert piece.shape == (rows, width)
        self.column += width
        if self.column == self.table.size(1):
            self.row, self.column = (self.row + rows) % self.table.size(0), 0
        return piece


@pytest.mark.parametrize("cfg", [0.0, 1.5])
def test_head_and_noise_pieces_change_no_token(model, monkeypatch, cfg):
    """The head projects HEAD_POSITIONS // block rows at a time and the noise comes in vocabulary slices: given
    the same noise per position, any piece sizes commit the same tokens as one pass over the block."""
    heads = []
    original = sampler_module.HeadBypass.to_logits
    monkeypatch.setattr(sampler_module.HeadBypass, "to_logits",
                        lambda self, rows: (heads.append(rows.size(0)), original(self, rows))[1])
    outputs = []
    for positions, elements in ((1 << 20, 1 << 22), (4, 1 << 22), (8, 40), (12, 7)):
        monkeypatch.setattr(sampler_module, "HEAD_POSITIONS", positions)
        monkeypatch.setattr(draws_module, "NOISE_ELEMENTS", elements)
        monkeypatch.setattr(draws_module, "gumbel_noise", TableNoise(len(IDS) * 4, model.config.vocab_size))
        heads.clear()
        outputs.append(generate(model, IDS, temperature=0.9, cfg_scale=cfg).tolist())
        rows_per_piece = max(1, positions // 4) * (2 if cfg else 1)  # block 4; CFG projects both halves together
        assert max(heads) == min(rows_per_piece, len(IDS) * (2 if cfg else 1))
    assert all(output == outputs[0] for output in outputs[1:])


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_sampling_in_vocabulary_slices_equals_one_pass(monkeypatch, temperature):
    """Slicing the vocabulary changes no token and no confidence: the running maximum keeps ties on the lower
    token id (as argmax does) and the running log-sum-exp is the whole one."""
    generator = torch.Generator().manual_seed(5)
    logits = torch.randn(6, 4, 53, generator=generator, dtype=torch.float64) * 3
    logits[0, 0, [7, 31, 52]] = 20.0  # a tie across slices: the lowest id wins
    logits[1, 2, [40, 41]] = 20.0  # a tie inside one slice
    outputs = []
    for elements in (1 << 22, 24 * 10, 24 * 7):  # one pass; slices of 10 and of 7 columns
        monkeypatch.setattr(draws_module, "NOISE_ELEMENTS", elements)
        monkeypatch.setattr(draws_module, "gumbel_noise", TableNoise(24, 53))
        outputs.append(sampler_module.sample_tokens(logits, temperature))
    for tokens, confidence in outputs[1:]:
        assert tokens.tolist() == outputs[0][0].tolist()
        torch.testing.assert_close(confidence, outputs[0][1], rtol=0, atol=1e-6)
    reference = logits.log_softmax(-1).gather(-1, outputs[0][0].unsqueeze(-1)).squeeze(-1).float()
    torch.testing.assert_close(outputs[0][1], reference, rtol=0, atol=1e-6)
    if temperature == 0:
        assert outputs[0][0][0, 0] == 7 and outputs[0][0][1, 2] == 40
        assert outputs[0][0].tolist() == logits.argmax(-1).tolist()


def test_sampling_leaves_the_logits_untouched():
    """The slices are float64 copies: float64 logits (a float64 model) are not overwritten by the in-place noise."""
    logits = torch.randn(2, 3, 11, dtype=torch.float64)
    before = logits.clone()
    sampler_module.sample_tokens(logits, 0.7, torch.Generator().manual_seed(0))
    assert torch.equal(logits, before)


def test_sampling_follows_the_tempered_distribution():
    """Gumbel-max at temperature T draws from softmax(l / T) (chi-square-free check on 3 tokens)."""
    logits = torch.tensor([[2.0, 1.0, 0.0]]).expand(20000, 3)
    generator = torch.Generator().manual_seed(0)
    tokens, _ = sampler_module.sample_tokens(logits, 0.5, generator)
    freq = torch.bincount(tokens, minlength=3).double() / len(tokens)
    torch.testing.assert_close(freq, torch.softmax(logits[0].double() / 0.5, -1), atol=0.01, rtol=0)


def test_the_step_loop_never_reads_a_tensor_back_to_the_host(model, monkeypatch):
    """No .item() / .tolist() / .cpu() / empty_cache() in the sampler's steps (d1 looped over rows with .item())."""
    ids, mask, padded = left_pad_tensors(IDS, TOKENIZER.pad_token_id, "cpu")
    calls = []
    for name in ("item", "tolist", "cpu", "numpy"):
        original = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _n=name, _o=original, **k: (calls.append(_n),
                                                                                              _o(self, *a, **k))[1])
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    diffusion_generate(model, ids, mask, gen_length=12, block_length=4, steps=6, mask_token_id=MASK,
                       pad_token_id=0, has_padding=padded, temperature=0.9)
    assert calls == []
