"""The opt-in block cache: exact where its reuse is exact (one layer), approximate otherwise, off by default.

Why it cannot be exact in general (the module's docstring): from the second layer on, the keys/values of
a committed prefix depend on the masked positions of the current block, which every step changes. A
one-layer model's keys/values depend on each token and its position only, so there the cache must give
the exact sampler's tokens bit for bit: that checks the mechanics (positions, the key order, the padding
mask, CFG's doubled rows, PEFT). On deeper models the agreement is measured, not assumed.
"""

import pytest
import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

from hf_grpo.diffusion.block_cache import BLOCK_CACHES, check_block_cache
from hf_grpo.diffusion.model import left_pad_tensors
from hf_grpo.diffusion.sampler import DiffusionSampler, diffusion_generate
from hf_grpo.recipe_support.diffusion_tiny import build_diffusion_tokenizer, build_tiny_diffusion_model

TOKENIZER = build_diffusion_tokenizer()
MASK, PAD = TOKENIZER.mask_token_id, TOKENIZER.pad_token_id
PADDED = [[5, 6, 7], [8, 9], [10, 11, 12, 13, 14], [4], [15, 16, 17, 18]]
EQUAL = [[5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16]]
OPTIONS = dict(gen_length=12, block_length=4, steps=12, mask_token_id=MASK, pad_token_id=PAD)  # 4 steps a block


def llama(layers, seed=0, dtype=torch.float64):
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=len(TOKENIZER), is_causal=False, use_cache=False)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).to(dtype).eval()


def generate(model, prompts, block_cache=None, seed=0, **kwargs):
    ids, mask, padded = left_pad_tensors(prompts, PAD, "cpu")
    generator = torch.Generator().manual_seed(seed)
    return diffusion_generate(model, ids, mask, has_padding=padded, generator=generator, block_cache=block_cache,
                              **{**OPTIONS, **kwargs})


class ForwardSpy:
    """Records the keyword arguments and the input width of every model forward."""

    def __init__(self, model):
        self.calls = []
        self.handle = model.register_forward_pre_hook(self.hook, with_kwargs=True)

    def hook(self, module, args, kwargs):
        self.calls.append(({k for k, v in kwargs.items() if v is not None and v is not False},
                           kwargs["input_ids"].size(1)))


@pytest.mark.parametrize("block_cache", BLOCK_CACHES)
@pytest.mark.parametrize("prompts", [PADDED, EQUAL], ids=["padded", "equal_lengths"])
@pytest.mark.parametrize("temperature, cfg", [(0.0, 0.0), (0.9, 0.0), (0.9, 1.5)])
def test_one_layer_model_cache_equals_the_exact_sampler(block_cache, prompts, temperature, cfg):
    model = llama(layers=1)
    exact = generate(model, prompts, temperature=temperature, cfg_scale=cfg)
    cached = generate(model, prompts, block_cache, temperature=temperature, cfg_scale=cfg)
    assert cached.tolist() == exact.tolist()


def test_one_layer_peft_model_cache_equals_the_exact_sampler():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(llama(layers=1), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                       init_lora_weights=False)).eval()
    assert generate(model, PADDED, "dual", temperature=0.9).tolist() == generate(model, PADDED,
                                                                                 temperature=0.9).tolist()


@pytest.mark.parametrize("block_cache, later_widths", [("dual", [4, 4, 4]), ("prefix", [12, 8, 4])])
def test_cached_steps_run_only_the_recomputed_columns(block_cache, later_widths):
    model = llama(layers=2)
    spy = ForwardSpy(model)
    generate(model, EQUAL, block_cache, temperature=0.9)
    width = 4 + 12
    widths = [w for _, w in spy.calls]
    # each block: one full forward, then 3 steps over the block (dual) or the block and the later blocks (prefix)
    assert widths == [width] + [later_widths[0]] * 3 + [width] + [later_widths[1]] * 3 + [width] + \
        [later_widths[2]] * 3
    assert all("position_ids" in kwargs and "cache" in kwargs for kwargs, w in spy.calls if w != width)


@pytest.mark.parametrize("block_cache", BLOCK_CACHES)
def test_the_keys_and_values_exist_once_for_the_whole_call(block_cache):
    """Each cache layer is one buffer of the row's columns for the whole call: the full forward of every block
    writes its kept columns there (no second copy to take them from) and every cached step its recomputed
    ones (no concatenation); the buffers never move, which a captured step relies on."""
    model = llama(layers=2)
    seen = []  # after each forward: every layer's key buffer (address, shape)
    model.register_forward_hook(
        lambda module, args, kwargs, output: seen.append([(layer.keys.data_ptr(), tuple(layer.keys.shape))
                                                          for layer in kwargs["cache"].layers])
        if kwargs.get("cache") is not None else None,
        with_kwargs=True)
    generate(model, EQUAL, block_cache, temperature=0.9)
    assert len(seen) == 12  # 3 blocks x (1 full forward + 3 cached steps), every one of them into the cache
    assert all(entry == seen[0] for entry in seen)
    assert all(shape[2] == 4 + 12 for _, shape in seen[0])  # prompt + generated columns, once


@pytest.mark.parametrize("block_cache", BLOCK_CACHES)
def test_the_cache_is_freed_when_the_call_returns_without_the_cyclic_collector(block_cache, monkeypatch):
    """No reference cycle keeps a call's cache (its key/value buffers) alive after the call: in a training
    run the next rollout would otherwise allocate its own beside it."""
    import gc
    import weakref

    from hf_grpo.diffusion import block_cache as block_cache_module

    made = []
    original = block_cache_module.BlockKVCache.__init__

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        made.append(weakref.ref(self))

    monkeypatch.setattr(block_cache_module.BlockKVCache, "__init__", init)
    gc.disable()
    try:
        generate(llama(layers=2), PADDED, block_cache, temperature=0.9)
        assert len(made) == 1 and made[0]() is None
    finally:
        gc.enable()


def test_default_path_is_unchanged_full_rows_and_no_cache():
    """block_cache=None: every step runs the whole row without positions or a cache (the exact sampler)."""
    model = llama(layers=2)
    spy = ForwardSpy(model)
    generate(model, PADDED, temperature=0.9)
    assert len(spy.calls) == 12
    for kwargs, width in spy.calls:
        assert width == 5 + 12
        assert not kwargs & {"position_ids", "cache", "past_key_values", "use_cache"}


def test_prefix_keys_depend_on_the_masked_block_so_no_exact_prefix_cache_exists():
    """The claim behind 'approximate': changing a current-block token changes the prefix's layer-2 keys."""
    model = llama(layers=2)
    row = torch.tensor([[5, 6, 7, 8, MASK, MASK, MASK, MASK]])
    changed = row.clone()
    changed[0, 4] = 9  # commit one token of the current block
    keys = []
    for ids in (row, changed):
        with torch.no_grad():
            cache = model(input_ids=ids, use_cache=True).cache
        keys.append([layer.keys[:, :, :4] for layer in cache.layers])  # the prompt's (prefix's) keys
    torch.testing.assert_close(keys[0][0], keys[1][0], rtol=0, atol=0)  # layer 1: a function of the token alone
    assert not torch.allclose(keys[0][1], keys[1][1])  # layer 2: depends on the block


@pytest.mark.parametrize("block_cache", BLOCK_CACHES)
def test_deeper_model_cache_is_an_approximation_with_measured_agreement(block_cache):
    """Token agreement with the exact sampler on 4-layer random models (greedy): reported, and far above chance."""
    agree, total = 0, 0
    for seed in range(3):
        model = llama(layers=4, seed=seed)
        exact = generate(model, PADDED)
        cached = generate(model, PADDED, block_cache)
        agree += int((exact == cached).sum())
        total += exact.numel()
    agreement = agree / total
    print(f"block_cache={block_cache}: {agreement:.3f} of tokens equal to the exact sampler's")
    assert agreement > 0.5  # chance is about 1 / vocabulary (1/53); a broken cache lands near it


@pytest.mark.parametrize("block_cache", BLOCK_CACHES)
def test_cached_sampler_is_chunk_and_padding_invariant(block_cache):
    """Rows never see each other through the cache: any chunking, or a row alone, gives the same tokens."""
    model = build_tiny_diffusion_model(TOKENIZER, seed=1).eval()
    ids = [TOKENIZER(p)["input_ids"] for p in ["ab>", "c>", "defgh>", "h>", "ij>", "klmno>", "p>"]]
    sampler = DiffusionSampler(block_length=4, steps=6, mask_token_id=MASK, block_cache=block_cache)
    config = GenerationConfig(max_new_tokens=12, do_sample=False)
    outputs = [sampler.generate(model, ids, generation_config=config, chunk_size=chunk, pad_token_id=PAD,
                                eos_token_ids=[]) for chunk in (1, 3, 7)]
    assert outputs[0] == outputs[1] == outputs[2]


@pytest.mark.parametrize("block_cache", [None, *BLOCK_CACHES])
@pytest.mark.parametrize("cfg", [0.0, 1.5])
def test_full_forwards_in_row_pieces_give_the_same_tokens(block_cache, cfg):
    """With a cache, tensor_batch_size bounds a block's full forward to tensor_batch_size // row length rows
    (at least one): the pieces write the same cache rows and the sampler commits the same tokens as with one
    forward of all rows. The exact sampler (no cache) keeps its every-step forwards whole."""
    model = llama(layers=2)
    width, rows = 5 + 12, len(PADDED) * (2 if cfg else 1)  # CFG doubles the rows
    full_forwards = 12 if block_cache is None else 3  # every step, or each block's first
    whole = generate(model, PADDED, block_cache, temperature=0.9, cfg_scale=cfg)
    for tensor_batch_size, piece in ((1, 1), (2 * width + 3, 2), (None, rows)):
        if block_cache is None:
            piece = rows
        seen = []  # rows of every forward over whole rows
        handle = model.register_forward_pre_hook(
            lambda module, args, kwargs: seen.append(kwargs["input_ids"].size(0))
            if kwargs["input_ids"].size(1) == width else None, with_kwargs=True)
        pieces = generate(model, PADDED, block_cache, temperature=0.9, cfg_scale=cfg,
                          tensor_batch_size=tensor_batch_size)
        handle.remove()
        assert pieces.tolist() == whole.tolist()
        assert len(seen) == full_forwards * -(-rows // piece) and max(seen) == piece
        assert sum(seen) == full_forwards * rows


def test_bad_tensor_batch_size_is_rejected_with_the_field_named():
    for bad in (0, -4, 2.5, True):
        with pytest.raises(ValueError, match=rf"tensor_batch_size must be a positive int .* got {bad!r}"):
            generate(llama(layers=1), EQUAL, tensor_batch_size=bad)


def test_bad_block_cache_settings_are_rejected_with_the_field_named():
    model = llama(layers=1)
    with pytest.raises(ValueError, match=r"block_cache must be None .* got 'full'"):
        check_block_cache("full", model, False, "mask2d")
    with pytest.raises(ValueError, match=r"block_cache='dual' supports unshifted logits"):
        check_block_cache("dual", model, True, "mask2d")
    with pytest.raises(ValueError, match=r"block_cache='prefix' supports padding_style='mask2d' only, got 'bias4d'"):
        check_block_cache("prefix", model, False, "bias4d")

    class NoCache(torch.nn.Module):
        def forward(self, input_ids, attention_mask=None):
            return input_ids

    with pytest.raises(ValueError, match=r"block_cache='dual' needs a model whose forward takes position_ids"):
        check_block_cache("dual", NoCache(), False, "mask2d")
    check_block_cache(None, NoCache(), True, "bias4d")  # the exact default needs nothing


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("block_cache", BLOCK_CACHES)
def test_cached_sampler_on_cuda_never_syncs_per_step(block_cache):
    """bf16 on CUDA, equal-length prompts: the whole cached sampling loop runs with the sync debugger set to error."""
    model = build_tiny_diffusion_model(TOKENIZER, seed=1, dtype=torch.bfloat16).cuda().eval()
    ids, mask, _ = left_pad_tensors(EQUAL, PAD, "cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = diffusion_generate(model, ids, mask, has_padding=False, temperature=0.9, block_cache=block_cache,
                                 **OPTIONS)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert not (out == MASK).any()


def test_cuda_graph_needs_a_block_cache_and_a_cuda_device():
    model = llama(layers=1)
    ids, mask, padded = left_pad_tensors(EQUAL, PAD, "cpu")
    with pytest.raises(ValueError, match=r"cuda_graph=True needs block_cache 'dual' or 'prefix' \(got None\), a CUDA device \(got 'cpu'\)"):
        diffusion_generate(model, ids, mask, has_padding=padded, cuda_graph=True, **OPTIONS)
    with pytest.raises(ValueError, match=r"cuda_graph=True captures the block cache's steps; it needs block_cache"):
        DiffusionSampler(block_length=4, steps=12, mask_token_id=MASK, cuda_graph=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("prompts", [PADDED, EQUAL], ids=["padded", "equal_lengths"])
@pytest.mark.parametrize("cfg", [0.0, 1.5])
def test_captured_dual_steps_sample_what_the_eager_ones_do(prompts, cfg):
    """The dual cache's step captured once and replayed gives the eager cached sampler's tokens (the same
    generator draws the same noise outside the graph), and replays: only the first block's step runs in Python."""
    model = llama(layers=2, dtype=torch.float32).cuda()
    ids, mask, padded = left_pad_tensors(prompts, PAD, "cuda")

    def run(cuda_graph):
        spy = ForwardSpy(model)
        generator = torch.Generator(device="cuda").manual_seed(3)
        out = diffusion_generate(model, ids, mask, has_padding=padded, generator=generator, block_cache="dual",
                                 cuda_graph=cuda_graph, temperature=0.9, cfg_scale=cfg, **OPTIONS)
        spy.handle.remove()
        return out, len(spy.calls)

    eager, eager_forwards = run(False)
    captured, captured_forwards = run(True)
    assert captured.tolist() == eager.tolist()
    assert eager_forwards == 12  # 3 blocks x (1 full forward + 3 cached steps)
    assert captured_forwards == 3 + 3  # 3 full forwards; 2 warm-ups and the capture, once for the call
