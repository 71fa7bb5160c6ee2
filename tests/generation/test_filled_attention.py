"""The decode attention that reads only the cache blocks a row attends to (``filled_attention``).

It must equal attention over the whole cache with the mask applied, never touch a position the mask
excludes, and read its bounds at replay time (a captured graph serves every step of a rollout). The
Triton kernel runs on CUDA only; on CPU the op is its torch reference, checked here against SDPA.
"""

from __future__ import annotations

import pytest
import torch

from hf_grpo.generation import filled_attention
from hf_grpo.generation.filled_attention import filled_decode_attention, reference_decode_attention, worth_the_kernel

needs_triton = pytest.mark.skipif(
    not (torch.cuda.is_available() and filled_attention.TRITON), reason="needs CUDA and Triton"
)


def _case(batch, kv_heads, groups, dim, length, dtype, device, seed=0):
    """A packed decode query, a cache, and a mask of left padding plus a causal cut at a random fill."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    query = torch.randn(batch, kv_heads, groups, dim, generator=g).to(device, dtype)
    key = torch.randn(batch, kv_heads, length, dim, generator=g).to(device, dtype)
    value = torch.randn(batch, kv_heads, length, dim, generator=g).to(device, dtype)
    filled = int(torch.randint(1, length + 1, (1,), generator=g))  # positions written so far, this token's included
    pads = torch.randint(0, filled, (batch,), generator=g)  # left padding of each row, fewer than filled
    pos = torch.arange(length)
    valid = (pos[None, :] >= pads[:, None]) & (pos[None, :] < filled)
    return query, key, value, valid.to(device), filled


def _sdpa(query, key, value, valid, scale):
    """Plain SDPA with each KV head repeated for its query heads, on the unpacked [B, H, 1, D] query."""
    batch, kv_heads, groups, dim = query.shape
    q = query.reshape(batch, kv_heads * groups, 1, dim)
    k = key.repeat_interleave(groups, dim=1)
    v = value.repeat_interleave(groups, dim=1)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=valid[:, None, None, :], scale=scale)
    return out.reshape(batch, kv_heads, groups, dim)


def test_reference_equals_sdpa_on_the_unpacked_query():
    query, key, value, valid, _ = _case(3, 2, 7, 16, 40, torch.float32, "cpu")
    got = filled_decode_attention(query, key, value, valid, 0.25)  # CPU: the torch reference
    torch.testing.assert_close(got, _sdpa(query, key, value, valid, 0.25), rtol=1e-5, atol=1e-6)


def _shared_case(device, dtype, length=300, prompt=120, seed=0):
    """Rows 0-2 hold prompt A, 3-4 prompt B, 5 prompt C (each with its own left padding); every row a cache
    whose prompt positions are a copy of its prompt's first row (``source``), as the shared prefill writes them.
    Returns that cache and one whose followers' prompt copies are poisoned (NaN, 1e4)."""
    source = torch.tensor([0, 0, 0, 3, 3, 5], dtype=torch.int32)
    query, key, value, _, filled = _case(6, 2, 7, 64, length, dtype, "cpu", seed)
    filled = max(filled, prompt + 1)
    pads = {0: 5, 3: 70, 5: 0}
    pos = torch.arange(length)
    valid = torch.stack([(pos >= pads[int(s)]) & (pos < filled) for s in source])
    key[:, :, :prompt], value[:, :, :prompt] = key[source.long(), :, :prompt], value[source.long(), :, :prompt]
    poisoned_key, poisoned_value = key.clone(), value.clone()
    followers = source != torch.arange(6)
    poisoned_key[followers, :, :prompt] = 1e4
    poisoned_value[followers, :, :prompt] = float("nan")
    to = dict(device=device)
    return ([t.to(**to) for t in (query, key, value, valid)], [t.to(**to) for t in (poisoned_key, poisoned_value)],
            source.to(**to), torch.tensor([prompt], dtype=torch.int32, device=device))


def test_rows_read_their_prompt_from_the_source_row():
    """GRPO's rows of one prompt: read from ``source``, the followers' own copies are never used."""
    (query, key, value, valid), (poisoned_key, poisoned_value), source, prompt_end = _shared_case("cpu",
                                                                                                  torch.float32)
    expected = filled_decode_attention(query, key, value, valid, 0.125)
    got = filled_decode_attention(query, poisoned_key, poisoned_value, valid, 0.125, source, prompt_end)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="source and prompt_end are given together"):
        filled_decode_attention(query, key, value, valid, 0.125, source)


def test_the_kernel_serves_decoders_with_a_program_for_every_sm():
    assert worth_the_kernel(256, 132)  # 128 rows x 2 KV heads on an H100
    assert not worth_the_kernel(64, 132)  # 32 rows x 2 KV heads: the matmul attention is as fast
    assert worth_the_kernel(8, 132, min_programs=8)  # what the GPU tests set to run it on tiny models


def test_long_caches_are_split_until_the_programs_fill_the_gpu():
    """Few rows over a long cache: each (row, KV head) is split so the programs fill the SMs twice; a short cache
    or rows that fill the GPU alone keep one program per (row, KV head)."""
    sms = 132  # an H100 / H200
    assert filled_attention.splits(32, 2, 4096 + 384, sms) == 5  # 0.5B x 32 rows, 4k completions: 320 programs
    assert filled_attention.splits(8, 4, 20480 + 256, sms) == 9  # 7B (4 KV heads) x 8 rows, 20k completions
    assert filled_attention.splits(32, 2, 768, sms) == 1  # too short to split: 32 x 2 stays on the matmul path
    assert filled_attention.splits(128, 2, 32768, sms) == 2  # 256 programs already fill the SMs once
    assert filled_attention.splits(1, 1, 10**6, sms) == filled_attention.CONFIG.max_splits
    assert worth_the_kernel(32 * 2 * filled_attention.splits(32, 2, 4480, sms), sms)


def test_a_cpu_decoder_asked_for_the_kernel_attends_with_matmul():
    from transformers import GenerationConfig

    from hf_grpo.generation.sampling import SamplingSettings
    from hf_grpo.generation.static_decoder import StaticDecoder
    from hf_grpo.recipe_support.tiny import build_char_tokenizer, build_tiny_model

    model = build_tiny_model(build_char_tokenizer()).eval()
    sampling = SamplingSettings.from_config(GenerationConfig(do_sample=False), eos_token_ids=[1], pad_token_id=0)
    decoder = StaticDecoder(model, batch=2, cache_len=16, sampling=sampling, decode_attention="filled")
    assert decoder.decode_attention == "matmul"


# ------------------------------------------------------------------------------------------------ GPU

SHAPES = [  # (batch, KV heads, groups, head dim, cache length)
    pytest.param(3, 2, 7, 64, 96, id="qwen0.5b-heads-3rows"),
    pytest.param(128, 2, 6, 128, 768, id="qwen1.5b-heads-128rows"),
    pytest.param(128, 2, 7, 64, 700, id="qwen0.5b-heads-128rows-ragged-cache"),
    pytest.param(2, 4, 1, 16, 50, id="no-grouping-short-cache"),
    pytest.param(5, 1, 4, 80, 200, id="head-dim-80"),
    # long caches, split over several programs per (row, KV head) and reduced
    pytest.param(32, 2, 7, 64, 1024, id="qwen0.5b-heads-32rows-1k"),
    pytest.param(32, 2, 7, 64, 4480, id="qwen0.5b-heads-32rows-4k"),
    pytest.param(8, 4, 7, 128, 16384, id="qwen7b-heads-8rows-16k"),
    pytest.param(4, 4, 7, 128, 32768, id="qwen7b-heads-4rows-32k"),
]


@pytest.mark.gpu
@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("batch,kv_heads,groups,dim,length", SHAPES)
def test_kernel_equals_attention_over_the_masked_cache(batch, kv_heads, groups, dim, length, dtype):
    for seed in range(3):
        query, key, value, valid, _ = _case(batch, kv_heads, groups, dim, length, dtype, "cuda", seed)
        scale = dim**-0.5
        got = filled_decode_attention(query, key, value, valid, scale)
        expected = reference_decode_attention(query.float(), key.float(), value.float(), valid, scale)
        tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
        assert got.dtype == dtype and got.shape == query.shape
        torch.testing.assert_close(got.float(), expected, **tol)


@pytest.mark.gpu
@needs_triton
@pytest.mark.parametrize("length", [700, 6000], ids=["one-program", "split"])
def test_a_mask_with_holes_and_an_empty_row_is_followed(length):
    """Masks other than a rollout's one span: holes (whole blocks of them too, a whole split's share in the long
    cache) and a row that attends nowhere."""
    query, key, value, _, _ = _case(6, 2, 7, 64, length, torch.float32, "cuda", seed=7)
    g = torch.Generator(device="cpu").manual_seed(7)
    valid = torch.rand(6, length, generator=g) < 0.3
    valid[1, 130:520] = False  # three whole blocks of 128 skipped between admitted positions
    valid[4, 600:length - 50] = False  # at 6000, several splits' shares hold nothing
    valid[2] = False
    valid[2, length - 1] = True  # only the last position
    valid[3] = False  # attends nowhere: zeros
    valid = valid.cuda()
    got = filled_decode_attention(query, key, value, valid, 0.125)
    expected = reference_decode_attention(query, key, value, valid, 0.125)
    torch.testing.assert_close(got[[0, 1, 2, 4, 5]], expected[[0, 1, 2, 4, 5]], rtol=1e-4, atol=1e-5)
    assert torch.equal(got[3], torch.zeros_like(got[3]))


@pytest.mark.gpu
@needs_triton
@pytest.mark.parametrize("batch,length", [(4, 300), (128, 300), (4, 5000)])
def test_positions_the_mask_excludes_are_never_read(batch, length):
    """NaN in every excluded position (stale or never-written cache) leaves the result finite and unchanged."""
    query, key, value, valid, _ = _case(batch, 2, 6, 64, length, torch.bfloat16, "cuda", seed=4)
    expected = filled_decode_attention(query, key, value, valid, 0.125)
    poisoned_key = key.masked_fill(~valid[:, None, :, None], float("nan"))
    poisoned_value = value.masked_fill(~valid[:, None, :, None], float("nan"))
    got = filled_decode_attention(query, poisoned_key, poisoned_value, valid, 0.125)
    assert torch.isfinite(got).all()
    assert torch.equal(got, expected)


@pytest.mark.gpu
@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("length", [300, 6000], ids=["one-program", "split"])
def test_the_kernel_reads_each_rows_prompt_from_its_source_row(length, dtype):
    """The followers' prompt copies poisoned (NaN values, huge keys): the kernel reads the source row's, over one
    program and over several splits a row (one of them straddling the prompt's end), and equals the reference."""
    (query, key, value, valid), (poisoned_key, poisoned_value), source, prompt_end = _shared_case(
        "cuda", dtype, length=length, prompt=1000 if length > 1000 else 120)
    scale = 0.125
    got = filled_decode_attention(query, poisoned_key, poisoned_value, valid, scale, source, prompt_end)
    expected = reference_decode_attention(query.float(), key.float(), value.float(), valid, scale)
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.float(), expected, **tol)
    # a captured call reads the source and the prompts' end at replay: with each row its own source, or no
    # prompt, the followers read their poisoned copies
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = filled_decode_attention(query, poisoned_key, poisoned_value, valid, scale, source, prompt_end)
    shared, end = source.clone(), prompt_end.clone()
    for rows, until, clean in ((shared, end, True), (torch.arange(6, device="cuda"), end, False),
                               (shared, end * 0, False), (shared, end, True)):
        source.copy_(rows)
        prompt_end.copy_(until)
        graph.replay()
        assert bool(torch.isfinite(out).all()) == clean
        if clean:
            torch.testing.assert_close(out.float(), expected, **tol)


@pytest.mark.gpu
@needs_triton
@pytest.mark.parametrize("length", [512, 8192], ids=["one-program", "split"])
def test_a_captured_call_follows_the_mask_it_reads_at_replay(length):
    """One graph, replayed as the cache fills: each replay attends over the mask of that step."""
    query, key, value, _, _ = _case(16, 2, 7, 64, length, torch.bfloat16, "cuda", seed=5)
    mask = torch.zeros((16, length), dtype=torch.bool, device="cuda")
    mask[:, :40] = True
    filled_decode_attention(query, key, value, mask, 0.125)  # compile the kernels outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = filled_decode_attention(query, key, value, mask, 0.125)
    for filled in sorted({41, 64, 65, 300, 512, length // 3, length}):
        mask.zero_()
        mask[:, 3:filled] = True
        graph.replay()
        expected = reference_decode_attention(query.float(), key.float(), value.float(), mask, 0.125)
        torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@needs_triton
def test_the_op_compiles_as_one_opaque_call():
    """Under torch.compile (as in the decode step) the op traces without a graph break and gives the same result."""
    query, key, value, valid, _ = _case(8, 2, 7, 64, 256, torch.bfloat16, "cuda", seed=6)

    def attend(q, k, v, m):
        return filled_decode_attention(q * 1.0, k, v, m, 0.125) + 0.0

    compiled = torch.compile(attend, fullgraph=True, dynamic=False)
    torch.testing.assert_close(compiled(query, key, value, valid), attend(query, key, value, valid))


@pytest.mark.gpu
@needs_triton
def test_layers_that_write_the_cache_then_attend_read_every_write_under_replay():
    """A decode step's order, many times over in one graph: a kernel writes this token's keys, values and query,
    the attention (split, and reduced) reads them next. Every layer's result equals the reference at every replay."""
    layers, length, filled = 12, 6000, 2500  # long enough that each (row, KV head) is split
    query, key, value, valid, _ = _case(16, 4, 7, 128, length, torch.bfloat16, "cuda", seed=8)
    valid[:, :filled] = True
    valid[:, filled:] = False
    keys = [key.clone() for _ in range(layers)]
    values = [value.clone() for _ in range(layers)]
    new_kv = torch.randn(layers, 2, 16, 4, 128, device="cuda").bfloat16()
    new_q = torch.randn(layers, *query.shape, device="cuda").bfloat16()
    queries = [query.clone() for _ in range(layers)]

    def step():
        outs = []
        for i in range(layers):
            keys[i][:, :, filled - 1].copy_(new_kv[i, 0] * 2.0)  # written by the kernel just before the attention
            values[i][:, :, filled - 1].copy_(new_kv[i, 1] * 2.0)
            queries[i].copy_(new_q[i])
            outs.append(filled_decode_attention(queries[i], keys[i], values[i], valid, 128**-0.5))
        return outs

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for _ in range(3):
        new_kv.normal_()
        new_q.normal_()
        graph.replay()
        torch.cuda.synchronize()
        for i in range(layers):
            expected = reference_decode_attention(queries[i].float(), keys[i].float(), values[i].float(), valid,
                                                  128**-0.5)
            torch.testing.assert_close(outs[i].float(), expected, rtol=2e-2, atol=2e-2)
        assert torch.equal(keys[0][:, :, filled - 1], new_kv[0, 0] * 2.0)
