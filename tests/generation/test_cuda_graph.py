"""The CUDA-graph generation backend: HF-identical greedy decoding, sampling law, live weights.

GPU tests are marked ``gpu`` and skipped without CUDA. The CPU tests check the fallback
rules, and run the backend's decode step eagerly (``use_cuda_graph=False``) against
``model.generate`` so that the padding/position/EOS logic and the sampling law are
exercised everywhere.
"""

from __future__ import annotations

import collections
import contextlib
import math
import random

import pytest
import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

from hf_grpo.generation import HFGenerateBackend, resolve_backend
from hf_grpo.generation import cuda_graph, filled_attention, sampling
from hf_grpo.generation.cuda_graph import CudaGraphBackend, cache_len_ladder
from hf_grpo.memory import decode_sizes
from hf_grpo.recipe_support.tiny import build_char_tokenizer, build_tiny_model

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
PAD, EOS = 0, 1


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


@pytest.fixture(autouse=True)
def _room_for_recompiles():
    """Each compiled test model/shape is one more dynamo entry for the shared decode function;
    the default limit (8) would silently send later tests to the eager forward. (Through dynamo's
    own ``config.patch``: pytest's monkeypatch deletes the key on undo, which hides it from torch.)"""
    with torch._dynamo.config.patch(recompile_limit=64):
        yield


def _prompts(tokenizer, n: int, seed: int = 0, max_len: int = 12) -> list[list[int]]:
    rng = random.Random(seed)
    return [
        tokenizer("".join(rng.choice("abcdefgh 123+=") for _ in range(rng.randint(1, max_len))))["input_ids"]
        for _ in range(n)
    ]


def _llama(tokenizer, seed: int = 0) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        pad_token_id=PAD,
        eos_token_id=EOS,
        bos_token_id=EOS,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def _bias_eos(model, prompts, max_new_tokens: int, device) -> None:
    """Make EOS the near-copy of the most frequent greedy token, so some rows stop mid-way."""
    gc = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=PAD, eos_token_id=EOS)
    out = HFGenerateBackend().generate(
        model, prompts, generation_config=gc, chunk_size=len(prompts), pad_token_id=PAD, eos_token_ids=[EOS]
    )
    counts = collections.Counter(t for row in out for t in row if t not in (PAD, EOS))
    token = counts.most_common(1)[0][0]
    with torch.no_grad():
        weight = model.get_output_embeddings().weight
        weight[EOS] = 1.05 * weight[token]


def _greedy_case(model, prompts, *, chunk_size: int, backend: CudaGraphBackend, max_new_tokens: int = 40, **gen):
    gc = GenerationConfig(
        max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=PAD, eos_token_id=EOS, **gen
    )
    kwargs = dict(generation_config=gc, chunk_size=chunk_size, pad_token_id=PAD, eos_token_ids=[EOS])
    with torch.no_grad():
        expected = HFGenerateBackend().generate(model, prompts, **kwargs)
        got = backend.generate(model, prompts, **kwargs)
    return expected, got


# ---------------------------------------------------------------------------------------- CPU


def test_auto_falls_back_to_hf_on_cpu(tokenizer):
    model = build_tiny_model(tokenizer)
    backend, reason = resolve_backend("auto", model)
    assert backend.name == "hf"
    assert reason is not None and "CUDA" in reason
    assert "CUDA" in CudaGraphBackend().unsupported_reason(model)


def test_unsupported_models_get_a_reason(tokenizer, monkeypatch):
    backend = CudaGraphBackend()
    model = build_tiny_model(tokenizer)
    # Pretend the model is on CUDA so that the family/attention checks are reached on CPU.
    monkeypatch.setattr("hf_grpo.generation.cuda_graph.model_device", lambda m: torch.device("cuda"))
    assert backend.unsupported_reason(model) is None

    model.config._attn_implementation = "flash_attention_2"
    assert "attention" in backend.unsupported_reason(model)
    model.config._attn_implementation = "sdpa"

    from transformers import T5Config, T5ForConditionalGeneration

    t5 = T5ForConditionalGeneration(T5Config(vocab_size=32, d_model=16, d_ff=32, num_layers=1, num_heads=2, d_kv=8))
    assert "encoder-decoder" in backend.unsupported_reason(t5)

    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=32, n_embd=16, n_layer=1, n_head=2))
    assert "gpt2" in backend.unsupported_reason(gpt2)


def test_cuda_graph_backend_refuses_cpu_models(tokenizer):
    model = build_tiny_model(tokenizer)
    gc = GenerationConfig(max_new_tokens=4, do_sample=False)
    with pytest.raises(ValueError, match="CUDA"):
        CudaGraphBackend().generate(
            model, [[3, 4]], generation_config=gc, chunk_size=2, pad_token_id=PAD, eos_token_ids=[EOS]
        )


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_eager_step_matches_generate_on_cpu(tokenizer, family):
    """The same decode logic without graphs: identical to model.generate, EOS mid-way, padded last chunk."""
    model = (build_tiny_model(tokenizer) if family == "qwen2" else _llama(tokenizer)).eval()
    prompts = _prompts(tokenizer, 11)
    _bias_eos(model, prompts, 40, "cpu")
    backend = CudaGraphBackend(use_cuda_graph=False, check_every=4)
    expected, got = _greedy_case(model, prompts, chunk_size=4, backend=backend)
    lengths = [len(c) for c in expected]
    assert min(lengths) < 40 and max(lengths) == 40, lengths  # some rows stop on EOS, some run out
    assert got == expected


def test_eager_step_matches_generate_with_penalty_and_min_tokens_on_cpu(tokenizer):
    model = build_tiny_model(tokenizer).eval()
    prompts = _prompts(tokenizer, 7, seed=1)
    _bias_eos(model, prompts, 30, "cpu")
    backend = CudaGraphBackend(use_cuda_graph=False)
    expected, got = _greedy_case(
        model, prompts, chunk_size=3, backend=backend, max_new_tokens=30, repetition_penalty=1.3, min_new_tokens=5
    )
    assert all(len(c) >= 5 for c in expected)
    assert got == expected


# A value that turns each unsupported setting on (model.generate would change the tokens for it).
UNSUPPORTED_EXAMPLES = dict(
    num_beams=2, num_beam_groups=2, diversity_penalty=0.5, num_return_sequences=2, constraints=[object()],
    force_words_ids=[[3]], penalty_alpha=0.6, dola_layers="high", no_repeat_ngram_size=2,
    encoder_no_repeat_ngram_size=2, encoder_repetition_penalty=1.3, bad_words_ids=[[3]], suppress_tokens=[3],
    begin_suppress_tokens=[3], sequence_bias={(3,): -1.0}, forced_bos_token_id=3, forced_eos_token_id=3,
    typical_p=0.9, epsilon_cutoff=3e-4, eta_cutoff=3e-4, top_h=0.4, guidance_scale=1.5,
    exponential_decay_length_penalty=(2, 1.1), watermarking_config={"greenlist_ratio": 0.25}, renormalize_logits=True,
    remove_invalid_values=True, token_healing=True, stop_strings=["ab"], max_time=5.0, prefill_chunk_size=4,
    prompt_lookup_num_tokens=3, assistant_early_exit=1, use_mtp=True, speculation_type="dflash", output_scores=True,
    output_logits=True, return_dict_in_generate=True,
)


def test_every_generation_setting_is_implemented_inert_or_unsupported():
    """Each field of the installed transformers' GenerationConfig is classified, once: a new field (or one left
    out) must be decided on, not dropped by the backend."""
    fields = set(GenerationConfig().to_dict())
    groups = {"implemented": sampling.IMPLEMENTED_SETTINGS, "no effect": set(sampling.NO_EFFECT_SETTINGS),
              "unsupported": sampling.UNSUPPORTED_SETTINGS}
    classified = set().union(*groups.values())
    assert fields <= classified, f"GenerationConfig fields nobody decided on: {sorted(fields - classified)}"
    assert classified <= fields, f"not GenerationConfig fields: {sorted(classified - fields)}"
    assert sum(len(group) for group in groups.values()) == len(classified), "a field is in two groups"
    assert set(UNSUPPORTED_EXAMPLES) == sampling.UNSUPPORTED_SETTINGS


class _RecordingFallback(HFGenerateBackend):
    def __init__(self):
        self.configs = []

    def generate(self, model, prompt_ids, *, generation_config, **kwargs):
        self.configs.append(generation_config)
        return [[EOS] for _ in prompt_ids]


def _served_by_fallback(model, prompts, gc) -> bool:
    backend = CudaGraphBackend(use_cuda_graph=False)
    backend._fallback = _RecordingFallback()
    backend.generate(model, prompts, generation_config=gc, chunk_size=2, pad_token_id=PAD, eos_token_ids=[EOS])
    assert backend._fallback.configs in ([], [gc]), "the fallback must get the call's own config"
    return bool(backend._fallback.configs)


@pytest.mark.parametrize("name", sorted(UNSUPPORTED_EXAMPLES))
def test_every_unsupported_setting_falls_back_to_generate_and_says_so(tokenizer, name, caplog):
    model = build_tiny_model(tokenizer).eval()
    prompts = _prompts(tokenizer, 3, seed=2)
    plain = dict(max_new_tokens=4, do_sample=True, pad_token_id=PAD, eos_token_id=EOS)
    assert not _served_by_fallback(model, prompts, GenerationConfig(**plain))  # the backend serves the plain call
    with caplog.at_level("WARNING", logger=cuda_graph.__name__):
        assert _served_by_fallback(model, prompts, GenerationConfig(**plain, **{name: UNSUPPORTED_EXAMPLES[name]}))
    assert f"generation setting {name}=" in caplog.text and "uses the hf backend" in caplog.text


def test_a_checkpoints_own_generation_setting_falls_back_too(tokenizer):
    """model.generate completes the call's config with the model's generation_config (a checkpoint's
    generation_config.json): a setting found there counts as the call's."""
    model = build_tiny_model(tokenizer).eval()
    prompts = _prompts(tokenizer, 3, seed=2)
    gc = GenerationConfig(max_new_tokens=4, do_sample=False, pad_token_id=PAD, eos_token_id=EOS)
    assert not _served_by_fallback(model, prompts, gc)
    model.generation_config.encoder_repetition_penalty = 1.3
    assert _served_by_fallback(model, prompts, gc)


def test_cache_len_ladder_rungs_and_bad_input():
    assert [cache_len_ladder(n) for n in (1, 256, 257, 385, 513, 769, 1025, 1537, 3073)] == [
        256, 256, 384, 512, 768, 1024, 1536, 2048, 4096]
    assert cache_len_ladder(100, minimum=64) == 128
    with pytest.raises(ValueError, match="need=0"):
        cache_len_ladder(0)


def _record_cache_lengths(monkeypatch) -> list[int]:
    """The cache length of every StaticDecoder the backend makes from now on."""
    made: list[int] = []

    class Recording(cuda_graph.StaticDecoder):
        def __init__(self, *args, **kwargs):
            made.append(kwargs["cache_len"])
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(cuda_graph, "StaticDecoder", Recording)
    return made


def test_varied_prompt_lengths_reuse_one_cache_that_only_grows(tokenizer, monkeypatch):
    """Real data: every rollout another prompt length. The cache follows the ladder, never one per length."""
    model = build_tiny_model(tokenizer).eval()
    backend = CudaGraphBackend(use_cuda_graph=False, min_cache_len=32)
    made = _record_cache_lengths(monkeypatch)
    gc = GenerationConfig(max_new_tokens=8, do_sample=False, pad_token_id=PAD, eos_token_id=EOS)
    rng = random.Random(0)
    for length in [5, 30, 12, 41, 3, 60, 20, 33, 7, 59]:  # longest prompt + 8 new tokens: 13 .. 68
        prompts = [[rng.randrange(2, len(tokenizer)) for _ in range(rng.randint(1, length))] for _ in range(3)]
        prompts[0] = [rng.randrange(2, len(tokenizer)) for _ in range(length)]
        got = backend.generate(model, prompts, generation_config=gc, chunk_size=4, pad_token_id=PAD,
                               eos_token_ids=[EOS])
        assert got == HFGenerateBackend().generate(model, prompts, generation_config=gc, chunk_size=4,
                                                   pad_token_id=PAD, eos_token_ids=[EOS])
    # 10 distinct lengths, four caches: 32 (13 positions), 48 (38), 64 (49), 96 (68); the shorter
    # calls in between reuse the cache in hand
    assert made == [32, 48, 64, 96]
    assert len(backend._entries) == 1 and backend.cache_bytes() > 0


def test_deepspeed_hooks_are_lifted_while_capturing_and_put_back_in_order():
    """ZeRO-1/2 engines hook the wrapped module with a host sync; a capture must not run it, others stay."""
    from hf_grpo.runtime.graph_capture import deepspeed_hooks_lifted

    calls = []

    def deepspeed_timer(module, args):
        calls.append("deepspeed")

    deepspeed_timer.__module__ = "deepspeed.runtime.engine"  # what DeepSpeed's own hook reports
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    model.register_forward_pre_hook(lambda m, a: calls.append("first"))
    model.register_forward_pre_hook(deepspeed_timer)
    model[0].register_forward_hook(lambda m, a, o: calls.append("inner"))
    model.register_forward_pre_hook(lambda m, a: calls.append("last"))
    before = list(model._forward_pre_hooks)
    with deepspeed_hooks_lifted(model):
        model(torch.zeros(1, 2))
    assert calls == ["first", "last", "inner"]
    assert list(model._forward_pre_hooks) == before  # restored, in order
    calls.clear()
    model(torch.zeros(1, 2))
    assert calls == ["first", "deepspeed", "last", "inner"]


def test_prefill_in_pieces_gives_the_tokens_of_a_whole_prefill(tokenizer, monkeypatch):
    """Long prompts go through the prefill 16 positions at a time (bounded attention scores), same tokens."""
    from hf_grpo.generation import static_decoder

    model = build_tiny_model(tokenizer).eval()
    monkeypatch.setattr(decode_sizes, "PREFILL_SCORE_BYTES", 1)  # the smallest piece: 16 positions
    calls = []
    forward = static_decoder.last_logits
    monkeypatch.setattr(static_decoder, "last_logits", lambda m, ids, *a: calls.append(ids.size(1)) or forward(m, ids, *a))
    backend = CudaGraphBackend(use_cuda_graph=False, min_cache_len=32)
    gc = GenerationConfig(max_new_tokens=6, do_sample=False, pad_token_id=PAD, eos_token_id=EOS)
    rng = random.Random(1)
    prompts = [[rng.randrange(2, len(tokenizer)) for _ in range(n)] for n in (50, 7, 33, 41)]
    got = backend.generate(model, prompts, generation_config=gc, chunk_size=4, pad_token_id=PAD, eos_token_ids=[EOS])
    assert calls[:4] == [16, 16, 16, 2]  # 50 padded positions in four pieces, then one-token steps
    assert got == HFGenerateBackend().generate(model, prompts, generation_config=gc, chunk_size=4, pad_token_id=PAD,
                                               eos_token_ids=[EOS])


def _spy_attention_keys(monkeypatch) -> list[tuple[int, int]]:
    """(query positions, key positions) of every sdpa attention call transformers makes from now on."""
    from transformers.integrations import sdpa_attention

    seen = []
    forward = sdpa_attention.sdpa_attention_forward

    def spy(module, query, key, *args, **kwargs):
        seen.append((query.shape[2], key.shape[2]))
        return forward(module, query, key, *args, **kwargs)

    monkeypatch.setattr(sdpa_attention, "sdpa_attention_forward", spy)
    return seen


def test_prefill_pieces_attend_to_the_positions_up_to_their_end_only(tokenizer, monkeypatch):
    """Each prefill piece reads the cache only up to its last prompt position (not the whole cache), one piece
    when its scores fit, and the tokens stay those of model.generate."""
    from hf_grpo.generation import static_decoder

    model = build_tiny_model(tokenizer).eval()
    layers = model.config.num_hidden_layers
    rng = random.Random(1)
    prompts = [[rng.randrange(2, len(tokenizer)) for _ in range(n)] for n in (50, 7, 33, 41)]
    gc = GenerationConfig(max_new_tokens=6, do_sample=False, pad_token_id=PAD, eos_token_id=EOS)
    expected = HFGenerateBackend().generate(model, prompts, generation_config=gc, chunk_size=4, pad_token_id=PAD,
                                            eos_token_ids=[EOS])
    call = dict(generation_config=gc, chunk_size=4, pad_token_id=PAD, eos_token_ids=[EOS])

    seen = _spy_attention_keys(monkeypatch)
    assert CudaGraphBackend(use_cuda_graph=False, min_cache_len=256).generate(model, prompts, **call) == expected
    assert seen[:layers] == [(50, 50)] * layers  # one piece, against 50 of the cache's 256 positions
    assert all(q == 1 for q, _ in seen[layers:])  # then one-token steps

    seen.clear()
    monkeypatch.setattr(decode_sizes, "PREFILL_SCORE_BYTES", 1)  # 16 positions a piece
    assert CudaGraphBackend(use_cuda_graph=False, min_cache_len=256).generate(model, prompts, **call) == expected
    pieces = [(16, 16), (16, 32), (16, 48), (2, 50)]
    assert seen[: 4 * layers] == [piece for piece in pieces for _ in range(layers)]


def test_an_eager_attention_prefill_keeps_pieces_sized_for_the_whole_cache(tokenizer, monkeypatch):
    """Eager attention reads (and scores) every cache position: its pieces stay bounded against the whole cache."""
    from hf_grpo.generation import static_decoder

    model = build_tiny_model(tokenizer, attn_implementation="eager").eval()
    heads = model.config.num_attention_heads
    # Room for 48 positions against 48 keys, not against the 256-position cache: the sliced plan would take one
    # 48-position piece, the whole-cache plan takes 16-position pieces.
    monkeypatch.setattr(decode_sizes, "PREFILL_SCORE_BYTES", 4 * heads * 48 * 48)
    calls = []
    forward = static_decoder.last_logits

    def counted(m, ids, *args):
        calls.append(ids.size(1))
        return forward(m, ids, *args)

    monkeypatch.setattr(static_decoder, "last_logits", counted)
    call = dict(generation_config=GenerationConfig(max_new_tokens=2, do_sample=False, pad_token_id=PAD,
                                                   eos_token_id=EOS),
                chunk_size=1, pad_token_id=PAD, eos_token_ids=[EOS])
    prompt = [list(range(2, 50))]  # 48 tokens, one row
    CudaGraphBackend(use_cuda_graph=False, min_cache_len=256).generate(model, prompt, **call)
    assert calls[:3] == [16, 16, 16]
    calls.clear()
    CudaGraphBackend(use_cuda_graph=False, min_cache_len=256).generate(build_tiny_model(tokenizer).eval(), prompt,
                                                                       **call)
    assert calls[0] == 48  # sdpa: one piece against its 48 keys


def test_prefill_against_the_filled_keys_equals_the_whole_cache_in_float64(tokenizer):
    """Cutting the masked cache positions off a left-padded prefill changes no logit (float64)."""
    from hf_grpo.generation.attention_routing import prefill_keys
    from hf_grpo.generation.static_cache import last_logits, static_cache

    model = build_tiny_model(tokenizer).double().eval()
    rng = random.Random(3)
    prompts = [[rng.randrange(2, len(tokenizer)) for _ in range(n)] for n in (9, 20, 14)]
    width = max(map(len, prompts))
    ids = torch.tensor([[PAD] * (width - len(p)) + p for p in prompts])
    mask2d = torch.ones((len(prompts), 64), dtype=torch.long)
    mask2d[:, :width] = (ids != PAD).long()
    positions = (mask2d[:, :width].cumsum(-1) - 1).clamp_min(0)
    results = []
    for sliced in (False, True):
        cache = static_cache(model.config, 64)
        logits = []
        with torch.no_grad():
            for start, end in ((0, 8), (8, width)):  # two pieces: the second also reads what the first wrote
                with prefill_keys(model, end) if sliced else contextlib.nullcontext():
                    logits.append(last_logits(model, ids[:, start:end], mask2d, positions[:, start:end], cache,
                                              "cache", True))
        results.append(torch.stack(logits))
    torch.testing.assert_close(results[1], results[0], rtol=0, atol=1e-12)


class _EagerReplay:
    """Stands in for a captured graph on CPU: each replay is one eager decode step."""

    def __init__(self, decoder, model):
        self.decoder, self.model = decoder, model

    def replay(self):
        self.decoder._decode_step(self.model)


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_capture_rewinds_instead_of_prefilling_again_and_keeps_the_tokens(tokenizer, family, monkeypatch):
    """On the GPU the first chunk's compile, warm-up and capture decode three throw-away tokens from the
    prefilled state; the decoder then puts back the state they advanced rather than prefilling again.
    Here the capture is simulated on CPU (three eager steps from another token, then an eager "graph"): one
    prefill per chunk, and the greedy tokens of model.generate."""
    from hf_grpo.generation import static_decoder

    prefills = []

    class EagerCapture(static_decoder.StaticDecoder):
        def run(self, model, input_ids, attention_mask, steps, *, use_graph, check_every):
            return super().run(model, input_ids, attention_mask, steps, use_graph=True, check_every=check_every)

        def _prefill(self, model, input_ids, attention_mask):
            prefills.append(input_ids.size(1))
            super()._prefill(model, input_ids, attention_mask)

        def _capture(self, model):
            # The compile call and two warm-ups decode three tokens (the capture itself runs nothing); they
            # are sampled on the GPU, so here they start from another token than the greedy one.
            self.tok.fill_(EOS + 1)
            for _ in range(3):
                self._decode_step(model)
            self.graph = _EagerReplay(self, model)

    monkeypatch.setattr(cuda_graph, "StaticDecoder", EagerCapture)
    model = (build_tiny_model(tokenizer) if family == "qwen2" else _llama(tokenizer)).eval()
    prompts = _prompts(tokenizer, 6, seed=3)
    _bias_eos(model, prompts, 20, "cpu")
    expected, got = _greedy_case(model, prompts, chunk_size=3, max_new_tokens=20,
                                 backend=CudaGraphBackend(use_cuda_graph=False, min_cache_len=32))
    assert got == expected
    assert len(prefills) == 2  # two chunks of three prompts, one prefill each


def test_a_reserved_length_sizes_one_cache_for_the_whole_run(tokenizer, monkeypatch):
    model = build_tiny_model(tokenizer).eval()
    backend = CudaGraphBackend(use_cuda_graph=False, min_cache_len=32)
    backend.reserve(60 + 8)  # the trainer's figure: the longest training prompt + max_completion_length
    made = _record_cache_lengths(monkeypatch)
    gc = GenerationConfig(max_new_tokens=8, do_sample=False, pad_token_id=PAD, eos_token_id=EOS)
    rng = random.Random(0)
    for length in [5, 30, 12, 41, 3, 60]:
        prompts = [[rng.randrange(2, len(tokenizer)) for _ in range(length)]]
        backend.generate(model, prompts, generation_config=gc, chunk_size=4, pad_token_id=PAD, eos_token_ids=[EOS])
    assert made == [96]  # one cache (68 positions -> rung 96) from the first call on
    with pytest.raises(ValueError, match="positive"):
        backend.reserve(0)


def test_the_memory_probe_of_a_cuda_graph_backend_is_eager_with_the_same_cache(tokenizer, monkeypatch):
    """memory.autosize measures generation with ``for_memory_probe()``: no compile or capture per probed size, the
    cache sized as the run's will be; other backends measure with themselves."""
    backend = CudaGraphBackend()  # as the trainer opens it
    backend.reserve(300 + 8)
    probe = backend.for_memory_probe()
    assert (probe.use_cuda_graph, probe.compile, probe.reserved_len) == (False, False, 308)
    made = _record_cache_lengths(monkeypatch)
    gc = GenerationConfig(max_new_tokens=8, do_sample=False, pad_token_id=PAD, eos_token_id=EOS)
    probe.generate(build_tiny_model(tokenizer).eval(), [[3, 4, 5]], generation_config=gc, chunk_size=1,
                   pad_token_id=PAD, eos_token_ids=[EOS])
    assert made == [cache_len_ladder(308, backend.min_cache_len)] and probe.num_compiles == 0  # the run's cache
    hf = HFGenerateBackend()
    assert hf.for_memory_probe() is hf


def test_a_long_reserved_length_is_sized_to_the_rows_not_a_rung_and_decodes_the_same_tokens(tokenizer, monkeypatch):
    # 1,100 positions (the longest prompt + max_completion_length) would sit on rung 1,536: a third of the cache
    # never filled. The reserved cache is 1,280 (1,100 rounded up to 256), and the tokens are those of the cache
    # an unreserved backend sizes for the call alone.
    model = build_tiny_model(tokenizer).eval()
    made = _record_cache_lengths(monkeypatch)
    gc = GenerationConfig(max_new_tokens=12, do_sample=False, pad_token_id=PAD, eos_token_id=EOS)
    prompts = _prompts(tokenizer, 3, seed=5)
    reserved = CudaGraphBackend(use_cuda_graph=False, min_cache_len=32)
    reserved.reserve(1100)
    got = reserved.generate(model, prompts, generation_config=gc, chunk_size=3, pad_token_id=PAD, eos_token_ids=[EOS])
    unreserved = CudaGraphBackend(use_cuda_graph=False, min_cache_len=32)  # the call's own rung: 32 positions
    expected = unreserved.generate(model, prompts, generation_config=gc, chunk_size=3, pad_token_id=PAD,
                                 eos_token_ids=[EOS])
    assert made == [1280, 32]
    assert got == expected
    assert cuda_graph.cache_positions(60, 1100, 32) == 1280  # a shorter call in the run uses the run's cache
    assert cuda_graph.cache_positions(1200, 1100, 32) == 1536  # past the reservation: the ladder, as unreserved
    assert cuda_graph.cache_positions(60, 68, 32) == 96  # short runs keep their rung (96 is below 256)


# ---------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(
    "compile,attention,scope",
    [(False, "sdpa", "layers"), (True, "sdpa", "layers"), (True, "matmul", "layers"), (True, "matmul", "model"),
     (True, "filled", "layers")],
    ids=["eager-graph", "compiled-sdpa", "compiled-matmul", "compiled-matmul-whole-model", "compiled-filled"],
)
@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_greedy_identical_to_generate(tokenizer, family, compile, attention, scope, monkeypatch):
    model = (build_tiny_model(tokenizer) if family == "qwen2" else _llama(tokenizer)).cuda().eval()
    prompts = _prompts(tokenizer, 11)
    _bias_eos(model, prompts, 40, "cuda")
    backend = CudaGraphBackend(compile=compile, decode_attention=attention, compile_scope=scope)
    assert backend.unsupported_reason(model) is None
    kernel_calls = []
    triton_attention = filled_attention._triton_decode_attention
    # 4 rows x 2 KV heads are fewer programs than SMs, where a decoder keeps the matmul attention
    monkeypatch.setattr(filled_attention, "CONFIG", filled_attention.KernelConfig(min_programs=1))
    monkeypatch.setattr(filled_attention, "_triton_decode_attention",
                        lambda *args: kernel_calls.append(1) or triton_attention(*args))
    expected, got = _greedy_case(model, prompts, chunk_size=4, backend=backend)  # 4 + 4 + 3 (padded)
    lengths = [len(c) for c in expected]
    assert min(lengths) < 40 and max(lengths) == 40, lengths
    assert got == expected
    # the "filled" step runs the Triton kernel (in the warm-up and the capture), not a fallback
    assert bool(kernel_calls) == (attention == "filled")
    assert backend.num_captures == 1  # one capture serves every chunk, the padded last one included
    assert backend.compile_error is None

    # Another call with the same shapes replays the same graph.
    expected2, got2 = _greedy_case(model, list(reversed(prompts)), chunk_size=4, backend=backend)
    assert got2 == expected2
    assert backend.num_captures == 1


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("scope", ["layers", "model"])
def test_rows_of_one_prompt_read_it_from_one_row_and_decode_as_generate(tokenizer, scope, monkeypatch):
    """GRPO's chunks, each prompt four times: the compiled step hands the kernel each row's prompt source (its
    prompt's first row), and greedy decoding gives model.generate's tokens."""
    model = build_tiny_model(tokenizer).cuda().eval()
    prompts = [p for p in _prompts(tokenizer, 3, seed=4) for _ in range(4)]
    _bias_eos(model, prompts, 40, "cuda")
    sources = []
    triton_attention = filled_attention._triton_decode_attention
    monkeypatch.setattr(filled_attention, "CONFIG", filled_attention.KernelConfig(min_programs=1))
    monkeypatch.setattr(filled_attention, "_triton_decode_attention",
                        lambda *args: sources.append(args[5]) or triton_attention(*args))
    backend = CudaGraphBackend(compile=True, decode_attention="filled", compile_scope=scope)
    expected, got = _greedy_case(model, prompts, chunk_size=8, backend=backend)  # 2 prompts x 4, then 1 x 4
    assert got == expected
    assert backend.compile_error is None
    assert sources and all(source is not None for source in sources)
    assert sources[-1][:4].tolist() == [0, 0, 0, 0]  # the last chunk's prompt, read from its row 0


@pytest.mark.gpu
@needs_cuda
def test_compiles_and_captures_stay_bounded_over_varied_prompt_lengths(tokenizer):
    model = build_tiny_model(tokenizer).cuda().eval()
    backend = CudaGraphBackend(compile=True, min_cache_len=32)
    rng = random.Random(1)
    for _ in range(12):
        prompts = [[rng.randrange(2, len(tokenizer)) for _ in range(rng.randint(2, 60))] for _ in range(4)]
        expected, got = _greedy_case(model, prompts, chunk_size=4, backend=backend, max_new_tokens=8)
        assert got == expected
    # needs of 10..68 positions: rungs 32, 48, 64, 96 at most, whatever the order
    assert backend.num_compiles <= 4 and backend.num_captures <= 4, (backend.num_compiles, backend.num_captures)


@pytest.mark.gpu
@needs_cuda
def test_greedy_with_penalty_min_tokens_and_padding_multiple(tokenizer):
    model = build_tiny_model(tokenizer).cuda().eval()
    prompts = _prompts(tokenizer, 9, seed=3)
    _bias_eos(model, prompts, 30, "cuda")
    backend = CudaGraphBackend(compile=False)
    gc = GenerationConfig(
        max_new_tokens=30, do_sample=False, pad_token_id=PAD, eos_token_id=EOS, repetition_penalty=1.3, min_new_tokens=5
    )
    kwargs = dict(generation_config=gc, chunk_size=4, pad_token_id=PAD, eos_token_ids=[EOS], pad_to_multiple_of=8)
    with torch.no_grad():
        expected = HFGenerateBackend().generate(model, prompts, **kwargs)
        got = backend.generate(model, prompts, **kwargs)
    assert all(len(c) >= 5 for c in expected)
    assert got == expected


@pytest.mark.gpu
@needs_cuda
def test_greedy_at_reasoning_lengths_identical_to_generate(tokenizer, monkeypatch):
    """8,192 new tokens a row (EOS held off by min_new_tokens): the split decode attention over a long cache, the
    cache's ladder of lengths and positions past 8k give model.generate's tokens (fp32; the head spread out so
    that a greedy pick is not a near-tie of float rounding)."""
    new_tokens = 8192
    model = build_tiny_model(tokenizer, max_position_embeddings=new_tokens + 64).cuda().eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(4.0)
    prompts = _prompts(tokenizer, 4, seed=7, max_len=40)
    split_calls = []
    # 4 rows x 2 KV heads are fewer programs than SMs: serve them anyway, and record the splits the kernel takes
    monkeypatch.setattr(filled_attention, "CONFIG", filled_attention.KernelConfig(min_programs=1))
    splits = filled_attention.splits
    monkeypatch.setattr(filled_attention, "splits",
                        lambda *args, **kwargs: split_calls.append(splits(*args, **kwargs)) or split_calls[-1])
    backend = CudaGraphBackend(compile=True, decode_attention="filled")
    expected, got = _greedy_case(model, prompts, chunk_size=4, backend=backend, max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens)
    assert [len(c) for c in expected] == [new_tokens] * 4
    assert max(split_calls) > 1, split_calls  # the long cache was split over several programs a row and head
    for row, (e, g) in enumerate(zip(expected, got)):
        first = next((i for i, (a, b) in enumerate(zip(e, g)) if a != b), None)
        assert first is None and len(g) == len(e), f"row {row}: first differing token at {first} of {len(e)}"


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("attention", ["sdpa", "matmul", "filled"])
def test_bf16_model_runs_and_matches_mostly(tokenizer, attention, monkeypatch):
    """bf16 and compiled: the benchmark's path; numerics may differ from generate in near-ties only."""
    monkeypatch.setattr(filled_attention, "CONFIG", filled_attention.KernelConfig(min_programs=1))
    model = build_tiny_model(tokenizer, dtype=torch.bfloat16).cuda().eval()
    prompts = _prompts(tokenizer, 16, seed=5)
    backend = CudaGraphBackend(compile=True, decode_attention=attention)
    expected, got = _greedy_case(model, prompts, chunk_size=8, backend=backend)
    same = sum(e == g for e, g in zip(expected, got))
    assert same >= 12, (same, expected, got)


def _constant_logit_model(tokenizer, seed: int = 0, device: str = "cuda"):
    """A model whose next-token logits are the same vector at every step and for every input.

    Every token embeds to the same vector, so every position carries the same hidden state
    (attention averages identical values), whatever the prompt or position: the sampled
    tokens are i.i.d., and each decode step replayed from the graph can be tested.
    """
    model = build_tiny_model(tokenizer, seed=seed).to(device).eval()
    with torch.no_grad():
        emb = model.get_input_embeddings().weight
        emb.copy_(emb[2].expand_as(emb))
        head = model.get_output_embeddings().weight
        head.mul_(4.0)  # spread the logits
        logits = model(torch.tensor([[5, 6, 7]], device=device)).logits[0, -1].float()
    return model, logits


# (device, compile): on the GPU the sampled step is checked captured eagerly and captured compiled, since
# the compiled token selection must sample the same law, with fresh noise at every replay.
SAMPLED_STEPS = [
    pytest.param("cpu", False, id="cpu"),
    pytest.param("cuda", False, marks=[pytest.mark.gpu, needs_cuda], id="cuda"),
    pytest.param("cuda", True, marks=[pytest.mark.gpu, needs_cuda], id="cuda-compiled"),
]


def _sample(model, n_rows: int, steps: int, compile: bool = False, **gen) -> list[list[int]]:
    gc = GenerationConfig(
        max_new_tokens=steps,
        min_new_tokens=steps,  # EOS is masked, so every row yields `steps` samples
        do_sample=True,
        pad_token_id=PAD,
        eos_token_id=EOS,
        **gen,
    )
    prompts = [[5, 6, 7]] * n_rows
    # On CPU the same decode step and sampling run eagerly, without a graph.
    backend = CudaGraphBackend(compile=compile, use_cuda_graph=model.device.type == "cuda")
    with torch.no_grad():
        return backend.generate(
            model, prompts, generation_config=gc, chunk_size=n_rows, pad_token_id=PAD, eos_token_ids=[EOS]
        )


def _chi_square_ok(counts: collections.Counter, probs: torch.Tensor, n: int) -> tuple[bool, float, int]:
    expected = probs.double() * n
    stat, df, lump_obs, lump_exp = 0.0, -1, 0.0, 0.0
    for token, e in enumerate(expected.tolist()):
        if e >= 5:
            stat += (counts.get(token, 0) - e) ** 2 / e
            df += 1
        else:
            lump_obs += counts.get(token, 0)
            lump_exp += e
    if lump_exp > 0:
        stat += (lump_obs - lump_exp) ** 2 / max(lump_exp, 1e-9)
        df += 1
    # chi2(df) has mean df and sd sqrt(2 df): 5 sigma above the mean.
    return stat <= df + 5 * math.sqrt(2 * df), stat, df


@pytest.mark.slow  # 15-40 s on a 2-core CPU
@pytest.mark.parametrize(("device", "compile"), SAMPLED_STEPS)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampling_follows_softmax(tokenizer, temperature, device, compile):
    torch.manual_seed(1234)
    model, logits = _constant_logit_model(tokenizer, device=device)
    rows, steps = 256, 64
    out = _sample(model, rows, steps, compile=compile, temperature=temperature, top_k=0, top_p=1.0)
    assert all(len(r) == steps for r in out)
    scaled = logits / temperature
    scaled[EOS] = float("-inf")  # min_new_tokens blocks EOS
    probs = scaled.softmax(-1).cpu()
    samples = [t for r in out for t in r]
    ok, stat, df = _chi_square_ok(collections.Counter(samples), probs, len(samples))
    assert ok, (stat, df)
    # Steps replayed from the graph draw fresh numbers: the last step alone follows the law too.
    last = collections.Counter(r[-1] for r in out)
    ok_last, stat_last, df_last = _chi_square_ok(last, probs, rows)
    assert ok_last, (stat_last, df_last)
    # ... and rows are not copies of each other.
    assert len({tuple(r) for r in out}) == rows


@pytest.mark.parametrize(("device", "compile"), SAMPLED_STEPS)
def test_top_k_two_only_emits_the_two_most_likely(tokenizer, device, compile):
    torch.manual_seed(99)
    model, logits = _constant_logit_model(tokenizer, seed=1, device=device)
    out = _sample(model, 128, 32, compile=compile, temperature=1.0, top_k=2)
    masked = logits.clone()
    masked[EOS] = float("-inf")
    top2 = set(torch.topk(masked, 2).indices.tolist())
    seen = collections.Counter(t for r in out for t in r)
    assert set(seen) <= top2 and len(seen) == 2, (seen, top2)
    p = masked[list(sorted(top2))].softmax(-1).cpu().double()
    n = sum(seen.values())
    first = sorted(top2)[0]
    sd = math.sqrt(n * p[0] * (1 - p[0]))
    assert abs(seen[first] - n * p[0]) <= 5 * sd


@pytest.mark.parametrize(("device", "compile"), SAMPLED_STEPS)
def test_top_p_and_min_p_cut_the_tail(tokenizer, device, compile):
    torch.manual_seed(7)
    model, logits = _constant_logit_model(tokenizer, seed=2, device=device)
    masked = logits.clone()
    masked[EOS] = float("-inf")
    probs = masked.softmax(-1)
    order = probs.argsort(descending=True)
    # top_p = mass of the 3 most likely tokens (minus a hair) keeps exactly those 3.
    top_p = float(probs[order[:3]].sum()) - 1e-4
    seen = collections.Counter(t for r in _sample(model, 128, 32, compile=compile, top_p=top_p) for t in r)
    assert set(seen) <= set(order[:3].tolist())
    # min_p = between the 2nd and 3rd token's ratio to the top keeps the 2 most likely.
    ratio2, ratio3 = float(probs[order[1]] / probs[order[0]]), float(probs[order[2]] / probs[order[0]])
    seen = collections.Counter(t for r in _sample(model, 128, 32, compile=compile, min_p=(ratio2 + ratio3) / 2) for t in r)
    assert set(seen) <= set(order[:2].tolist())


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("compile", [False, True], ids=["eager-graph", "compiled-graph"])
def test_replayed_graph_follows_in_place_weight_updates(tokenizer, compile):
    model = build_tiny_model(tokenizer).cuda()
    prompts = _prompts(tokenizer, 6, seed=11)
    backend = CudaGraphBackend(compile=compile)
    before_expected, before = _greedy_case(model, prompts, chunk_size=4, backend=backend, max_new_tokens=24)
    assert before == before_expected
    captures = backend.num_captures

    # An optimizer step updates the parameters in place: same addresses, new values.
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    ids = torch.tensor(prompts[0], device="cuda")[None]
    model(ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    after_expected, after = _greedy_case(model, prompts, chunk_size=4, backend=backend, max_new_tokens=24)
    assert after_expected != before_expected  # the update changed the model's output...
    assert after == after_expected  # ...and the replayed graph follows it
    assert backend.num_captures == captures  # without capturing again

    # A parameter replaced by a new tensor moves its address: the backend captures again.
    with torch.no_grad():
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone() * 1.5)
    moved_expected, moved = _greedy_case(model, prompts, chunk_size=4, backend=backend, max_new_tokens=24)
    assert moved == moved_expected
    assert backend.num_captures == captures + 1
    assert backend.compile_error is None


@pytest.mark.gpu
@needs_cuda
def test_model_left_usable_by_generate(tokenizer):
    """model.generate between graph replays is unaffected (no state left on the model)."""
    model = build_tiny_model(tokenizer).cuda().eval()
    prompts = _prompts(tokenizer, 5, seed=21)
    backend = CudaGraphBackend(compile=False)
    e1, g1 = _greedy_case(model, prompts, chunk_size=5, backend=backend)
    e2, g2 = _greedy_case(model, prompts, chunk_size=5, backend=backend)
    assert e1 == e2 == g1 == g2


@pytest.mark.gpu
@needs_cuda
def test_unsupported_generation_setting_falls_back(tokenizer):
    model = build_tiny_model(tokenizer).cuda().eval()
    prompts = _prompts(tokenizer, 3, seed=2)
    backend = CudaGraphBackend(compile=False)
    expected, got = _greedy_case(model, prompts, chunk_size=2, backend=backend, no_repeat_ngram_size=2)
    assert got == expected
    assert backend.num_captures == 0
