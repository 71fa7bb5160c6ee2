"""hf_grpo.memory.context_fit: the estimate's terms against hand-computed figures (Qwen2.5-7B's dimensions, from the
config alone) and against a tiny model's real parameters and decoder cache; the refusal a run that cannot fit gets."""

import pytest
import torch

from hf_grpo.memory import context_fit as cf
from hf_grpo.recipe_support.tiny import SHAPES, build_char_tokenizer, build_tiny_model
from hf_grpo.run_state import RunFacts, RunSizes

GIB = 2**30
QWEN_7B = {**SHAPES["7b"], "model_type": "qwen2", "torch_dtype": "bfloat16"}


def shape_7b(**changes):
    """8 completions generated at once after a 1,024-token prompt, LoRA r16 on every projection, one row a pass."""
    return cf.RunShape(**{"prompt": 1024, "generation_rows": 8, "lora_rank": 16, **changes})


def test_qwen_7b_dimensions_give_its_parameters_cache_and_adapters():
    dims = cf.ModelDims.from_config(QWEN_7B)
    h, i, kv = 3584, 18944, 4 * 128
    block = (h * h + h) + 2 * (h * kv + kv) + h * h + 3 * h * i + 2 * h  # q, k, v (biased), o; MLP; two norms
    assert dims.parameter_count() == 28 * block + 2 * 151936 * h + h == 7_614_699_008
    assert dims.kv_bytes_per_position() == 28 * 2 * 4 * 128 * 2 == 57_344  # 56 KiB a token
    # r16 on q, k, v, o, gate, up, down: r x (in + out) each
    assert dims.lora_parameters(16) == 28 * 16 * ((h + h) + 2 * (h + kv) + (h + h) + 2 * (h + i) + (i + h))


def test_each_phase_of_a_7b_lora_step_at_64k_is_the_sum_of_its_hand_computed_terms():
    dims, shape = cf.ModelDims.from_config(QWEN_7B), shape_7b()
    est = cf.estimate(dims, shape, 65536)
    h, i, tokens = 3584, 18944, 1024 + 65536
    weights, adapters = 7_614_699_008 * 2, dims.lora_parameters(16)
    resident = weights + adapters * 4 + adapters * 8  # bf16 weights; fp32 adapters and their two moments
    # the KV cache: 8 rows x 66,560 positions (a multiple of 256: no ladder rung, which would be 98,304)
    assert est.phases["rollout"]["KV cache"] == 8 * 66560 * 57344
    # the largest prefill piece: the first, 544 positions, whose 8 x 28 heads x 544 x 544 fp32 scores fit 256 MiB
    prefill = 8 * 28 * 4 * 544 * 544 + 8 * 544 * (3 * i + 4 * h) * 2
    assert 8 * 28 * 4 * 560 * 560 > 256 * 2**20 >= 8 * 28 * 4 * 544 * 544
    assert est.total("rollout") == resident + 8 * 66560 * 57344 + 8 * 66560 * (8 + 8 + 4) + 28 * h * (28 + 8) * 128 * 2 + \
        prefill + 3 * 8 * 151936 * 4
    saved = 8 * h + 2 * 2 * h + (3 * 28 + 2 * 4) * 128 * 2 + 4 * 2 * i  # per token, one layer
    backward = 3 * 2 * i + 8 * h
    head = 1024 * 32768 * 4 * 2 + 32768 * h * 4 + tokens * 16
    assert est.total("training") == resident + adapters * 4 + 28 * tokens * h * 2 + tokens * (saved + backward) + \
        2 * tokens * h * 2 + head
    assert est.total("scoring") == resident + 2 * tokens * saved + (1024 * 32768 * 8 + 32768 * h * 4 + 2 * tokens * 16)
    assert est.peak_phase == "training"
    # about 13 GB of checkpointed layer inputs, as the arithmetic says
    assert 13.0e9 < est.phases["training"]["layer inputs (checkpointed)"] < 13.5e9


def test_the_longest_completion_is_the_last_length_under_the_device_and_grows_with_memory():
    dims, shape = cf.ModelDims.from_config(QWEN_7B), shape_7b()
    h100 = int(79.19 * GIB)  # what torch reports for an 80 GB H100
    longest = cf.longest_completion(dims, shape, h100)
    usable = h100 - cf.CONTEXT_BYTES
    assert cf.estimate(dims, shape, longest).peak <= usable < cf.estimate(dims, shape, longest + 1).peak
    assert longest >= 65536  # the estimate says 8 x 64k fits an H100 with LoRA r16 and checkpointing
    assert cf.longest_completion(dims, shape, 2 * h100) > longest
    # without activation checkpointing every layer keeps its tensors: far shorter
    assert cf.longest_completion(dims, shape_7b(checkpointing=False), h100) < longest // 4
    assert cf.longest_completion(dims, shape, 15 * GIB) == 0  # not even the weights fit


def test_a_run_past_the_limit_is_refused_naming_the_fields_and_the_longest_that_fits():
    dims, shape = cf.ModelDims.from_config(QWEN_7B), shape_7b(generation_rows=64)
    device = int(79.19 * GIB)
    longest = cf.longest_completion(dims, shape, device)
    message = cf.refusal(dims, shape, device, 65536)
    assert message.startswith("max_completion_length=65,536 does not fit on this device")
    assert f"lower max_completion_length to {longest:,} or less" in message
    assert "per_device_generation_batch_size=64" in message  # the rollout peaks: its cache is what to lower
    assert "HF_GRPO_FIT_CHECK=off" in message
    assert cf.refusal(dims, shape, device, longest) is None
    text, fits = cf.summary(dims, shape, device, longest)
    assert fits and f"is {longest:,} tokens" in text


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_a_tiny_models_parameters_and_decoder_cache_are_the_estimates(family):
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_grpo.generation.sampling import SamplingSettings
    from hf_grpo.generation.static_decoder import StaticDecoder

    tokenizer = build_char_tokenizer()
    if family == "qwen2":
        model = build_tiny_model(tokenizer)
    else:
        model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))
    dims = cf.ModelDims.from_config(model.config, weight_bytes=4)
    assert dims.parameter_count() == sum(p.numel() for p in model.parameters())
    shape = cf.RunShape(prompt=40, generation_rows=3, backend="cuda_graph")
    terms = cf.rollout_bytes(dims, shape, 60)
    cache_len = cf.cache_positions(shape, 100)
    assert cache_len == 256  # the ladder's first rung holds 100 positions
    sampling = SamplingSettings(do_sample=False, temperature=1.0, top_k=0, top_p=1.0, min_p=None,
                                repetition_penalty=1.0, min_new_tokens=0, min_length=0, eos_token_ids=(1,),
                                pad_token_id=0)
    decoder = StaticDecoder(model, batch=3, cache_len=cache_len, sampling=sampling)
    prompts = torch.randint(2, dims.vocab, (3, 40))
    decoder.run(model, prompts, torch.ones_like(prompts), 1, use_graph=False, check_every=1)  # fills the cache
    # the cache and the [rows, cache_len] buffers; the [rows, 1] token and position buffers are the rest
    assert decoder.nbytes() == terms["KV cache"] + terms["decoder buffers"] + 2 * 3 * 8


def test_lora_adapters_counted_from_the_dimensions_are_peft_s():
    peft = pytest.importorskip("peft")
    model = build_tiny_model(build_char_tokenizer())
    dims = cf.ModelDims.from_config(model.config)
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=list(cf.LORA_TARGETS)))
    assert dims.lora_parameters(4) == sum(p.numel() for p in lora.parameters() if p.requires_grad)


def test_train_begin_refuses_a_completion_the_device_cannot_fit_and_logs_the_limit(caplog, monkeypatch):
    model = build_tiny_model(build_char_tokenizer())
    sizes = RunSizes(per_device_train_batch_size=2, gradient_accumulation_steps=1, steps_per_generation=2,
                     per_device_generation_batch_size=4, tensor_batch_size=64, max_tokens_per_micro_batch=None)
    facts = RunFacts(activation_checkpointing=True, max_completion_length=4096)
    run = dict(prompt=lambda: 32, packed=True, reference=False, backend="cuda_graph", device=torch.device("cpu"))
    with pytest.raises(ValueError, match=r"max_completion_length=4,096 does not fit on this device.*"
                                         r"lower max_completion_length to [0-9,]+ or less"):
        cf.check_run(model, sizes, facts, main=True, device_bytes=cf.CONTEXT_BYTES + 20 * 2**20, **run)
    with caplog.at_level("INFO", logger="hf_grpo"):
        cf.check_run(model, sizes, facts, main=True, device_bytes=cf.CONTEXT_BYTES + 2**30, **run)
    assert "memory: the longest completion these sizes fit" in caplog.text
    monkeypatch.setenv(cf.SKIP_VARIABLE, "off")  # the user's way past a wrong estimate
    cf.check_run(model, sizes, facts, main=True, device_bytes=cf.CONTEXT_BYTES + 20 * 2**20, **run)
    monkeypatch.setenv(cf.SKIP_VARIABLE, "maybe")
    with pytest.raises(ValueError, match="HF_GRPO_FIT_CHECK must be 'on' or 'off', got 'maybe'"):
        cf.check_run(model, sizes, facts, main=True, device_bytes=cf.CONTEXT_BYTES + 2**30, **run)
    # on CPU with no figure given, nothing is estimated
    monkeypatch.delenv(cf.SKIP_VARIABLE)
    assert cf.check_run(model, sizes, facts, main=True, **run) is None


def test_the_trainer_refuses_at_train_begin_before_any_rollout(tmp_path, monkeypatch):
    # The estimate needs a GPU's memory; here the check is handed a device of 1 GiB + 20 MiB, as a CUDA run would
    # read it, to show the trainer's own model, sizes and facts reach it before the first rollout.
    from datasets import Dataset

    from hf_grpo import GRPOConfig, GRPOTrainer
    from hf_grpo.generation import HFGenerateBackend

    tokenizer = build_char_tokenizer()
    check = cf.check_run
    monkeypatch.setattr(cf, "check_run", lambda *a, **k: check(*a, **{**k, "device_bytes": cf.CONTEXT_BYTES + 20 * 2**20}))

    class NoRollout(HFGenerateBackend):
        def generate(self, model, prompt_ids, **kwargs):
            raise AssertionError("a rollout started before the run was refused")

    args = GRPOConfig(output_dir=str(tmp_path / "out"), report_to=[], use_cpu=True, bf16=False, max_steps=1,
                      per_device_train_batch_size=4, num_generations=4, max_completion_length=2048,
                      save_strategy="no", disable_tqdm=True, activation_checkpointing=True)
    trainer = GRPOTrainer(model=build_tiny_model(tokenizer), reward_funcs=lambda completions, **k: [0.0] * len(
        completions), args=args, train_dataset=Dataset.from_dict({"prompt": ["ab>"] * 8}), processing_class=tokenizer)
    trainer.decisions.backend = NoRollout()
    with pytest.raises(ValueError, match=r"max_completion_length=2,048 does not fit on this device"):
        trainer.train()
