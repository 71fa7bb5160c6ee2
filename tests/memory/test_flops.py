"""The work counts behind the efficiency figures (hf_grpo.memory.flops), against counts made by hand, and the
trainer's figures: present where the device's rates are measured, absent on a CPU."""

import json

import pytest
import torch
from peft import LoraConfig, get_peft_model

from hf_grpo.memory import device_rates as rates_module
from hf_grpo.memory.device_rates import DeviceRates
from hf_grpo.memory.flops import BatchTokens, ModelWork
from hf_grpo.recipe_support.tiny import build_char_tokenizer, build_tiny_model, build_tiny_moe_model

TOKENIZER = build_char_tokenizer()
# the "tiny" shape: hidden 64, MLP 128, 2 layers, 4 heads of 16, 2 key/value heads, untied head
H, I, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 64, 128, 2, 4, 2, 16
V = len(TOKENIZER)
LAYER_MATMULS = H * HEADS * HEAD_DIM + 2 * H * KV_HEADS * HEAD_DIM + HEADS * HEAD_DIM * H + 3 * H * I


def test_a_plain_model_s_work_is_read_from_its_layers():
    work = ModelWork.from_model(build_tiny_model(TOKENIZER, seed=0))
    assert (work.layers, work.layer_matmul_params, work.layer_trainable_matmul_params) == (
        LAYERS, LAYER_MATMULS, LAYER_MATMULS)
    assert (work.attention_width, work.hidden, work.vocab, work.head_trainable) == (HEADS * HEAD_DIM, H, V, True)
    assert work.kv_bytes_per_token == LAYERS * 2 * KV_HEADS * HEAD_DIM * 4  # fp32
    assert work.decode_weight_bytes == (LAYERS * LAYER_MATMULS + V * H) * 4


def test_lora_adapters_count_as_the_only_trainable_matmuls_and_a_decode_step_reads_the_base_alone():
    model = get_peft_model(build_tiny_model(TOKENIZER, seed=0),
                           LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    work = ModelWork.from_model(model.get_base_model())
    adapters = 4 * (H + HEADS * HEAD_DIM) + 4 * (H + KV_HEADS * HEAD_DIM)  # A: r x in, B: out x r, for q and v
    assert work.layer_matmul_params == LAYER_MATMULS + adapters
    assert work.layer_trainable_matmul_params == adapters
    assert not work.head_trainable
    assert work.decode_weight_bytes == (LAYERS * LAYER_MATMULS + V * H) * 4


def test_models_whose_work_the_rules_do_not_describe_are_not_counted():
    assert ModelWork.from_model(build_tiny_moe_model(TOKENIZER, "mixtral")) is None  # a token runs some experts
    assert ModelWork.from_model(build_tiny_model(TOKENIZER, seed=0, is_causal=False)) is None  # masked diffusion


def test_forward_and_training_flops_follow_the_per_token_rules():
    work = ModelWork.from_model(build_tiny_model(TOKENIZER, seed=0))
    tokens, pairs, scored = 10, 40, 6
    layer_forward = 2 * LAYER_MATMULS * tokens + 4 * HEADS * HEAD_DIM * pairs
    head = 2 * H * V * scored
    assert work.forward_flops(tokens, pairs, scored) == LAYERS * layer_forward + head
    backward = 2 * LAYER_MATMULS * tokens * 2 + 8 * HEADS * HEAD_DIM * pairs  # every matmul trains here
    # forward, recomputed logits, hidden states' gradient, the trained head's gradient
    assert work.training_flops(tokens, pairs, scored, recompute=False) == LAYERS * (layer_forward + backward) + 4 * head
    assert (work.training_flops(tokens, pairs, scored, recompute=True)
            - work.training_flops(tokens, pairs, scored, recompute=False)) == LAYERS * layer_forward


def test_a_group_s_shared_prompt_is_counted_once_and_padding_not_at_all():
    # two prompts (3 and 2 tokens, left-padded to 3), two completions each (2, 1, 3, 2 tokens, right-padded to 3)
    input_ids = torch.tensor([[5, 6, 7, 10, 11, 0],
                              [5, 6, 7, 12, 0, 0],
                              [0, 8, 9, 13, 14, 15],
                              [0, 8, 9, 16, 17, 0]])
    attention_mask = (torch.tensor([[1, 1, 1, 1, 1, 0],
                                    [1, 1, 1, 1, 0, 0],
                                    [0, 1, 1, 1, 1, 1],
                                    [0, 1, 1, 1, 1, 0]]))
    batch = BatchTokens.from_masks(input_ids, attention_mask, logits_to_keep=3)
    assert batch.tokens == 3 + 2 + (2 + 1 + 3 + 2)
    prompts = 3 * 4 // 2 + 2 * 3 // 2  # each prompt's causal pairs, once
    completions = (2 * 3 + 3) + (1 * 3 + 1) + (3 * 2 + 6) + (2 * 2 + 3)  # c * p + c (c + 1) / 2
    assert batch.pairs == prompts + completions
    assert batch.scored == 8


def test_rows_with_different_prompts_share_nothing():
    input_ids = torch.tensor([[5, 6, 10], [5, 7, 10]])
    batch = BatchTokens.from_masks(input_ids, torch.ones_like(input_ids), logits_to_keep=1)
    assert (batch.tokens, batch.pairs, batch.scored) == (6, 2 * (3 + 1 * 2 + 1), 2)


def test_decode_bytes_read_the_weights_once_a_step_and_each_running_row_s_cache():
    work = ModelWork.from_model(build_tiny_model(TOKENIZER, seed=0))
    w, kv = work.decode_weight_bytes, work.kv_bytes_per_token
    # chunk 1: prompts 3 and 5, completions 4 and 2: 3 decode steps (the first token comes from the prefill);
    # row 0 reads 3+1, 3+2, 3+3 tokens, row 1 reads 5+1. Chunk 2: one row, prompt 2, completion 1: no decode step.
    assert work.decode_bytes([3, 5, 2], [4, 2, 1], chunk=2) == 3 * w + (4 + 5 + 6 + 6) * kv
    assert work.decode_bytes([3, 5, 2], [4, 2, 1], chunk=3) == 3 * w + (4 + 5 + 6 + 6) * kv
    assert work.prefill_flops([3]) == work.forward_flops(3, 6, 1)


def test_decode_bytes_count_a_prompt_that_rows_of_a_chunk_share_once_a_step():
    work = ModelWork.from_model(build_tiny_model(TOKENIZER, seed=0))
    w, kv = work.decode_weight_bytes, work.kv_bytes_per_token
    # rows 0-2 hold prompt A (4 tokens), completions 3, 5, 1; row 3 prompt B (2 tokens), completion 2. Decode
    # steps: 4. Prompt A is read while row 1 runs (4 steps), B for 1; the rows' own tokens 1+2, 1+2+3+4, -, 1.
    shared = work.decode_bytes([4, 4, 4, 2], [3, 5, 1, 2], chunk=4, prompt_groups=[0, 0, 0, 1])
    assert shared == 4 * w + (4 * 4 + 1 * 2 + 3 + 10 + 1) * kv
    # each row its own prompt: A read for 2, 4 and 0 steps
    assert work.decode_bytes([4, 4, 4, 2], [3, 5, 1, 2], chunk=4) == 4 * w + ((2 + 4) * 4 + 2 + 3 + 10 + 1) * kv
    # the same prompt in two chunks is read in each
    assert work.decode_bytes([4, 4], [3, 3], chunk=1, prompt_groups=[0, 0]) == 4 * w + 2 * (2 * 4 + 3) * kv


def test_device_rates_are_none_on_a_cpu_and_read_back_from_the_cache(tmp_path, monkeypatch):
    assert rates_module.device_rates(torch.device("cpu")) is None
    monkeypatch.setenv(rates_module.CACHE_ENV, str(tmp_path))
    rates = DeviceRates("GPU X", 800.0, 3000.0)
    key = "GPU X | torch t | cuda c"
    (tmp_path / rates_module.CACHE_FILE).write_text(json.dumps({key: {"device_name": "GPU X", "matmul_tflops": 800.0,
                                                                      "copy_gbps": 3000.0}}))
    monkeypatch.setattr(rates_module, "_key", lambda device: key)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(rates_module, "measure", lambda device: pytest.fail("measured again despite the cache"))
    assert rates_module.device_rates(torch.device("cuda")) == rates


def test_a_torn_cache_is_measured_again_and_replaced_whole(tmp_path, monkeypatch):
    monkeypatch.setenv(rates_module.CACHE_ENV, str(tmp_path))
    (tmp_path / rates_module.CACHE_FILE).write_text('{"GPU X | tor')
    monkeypatch.setattr(rates_module, "_key", lambda device: "GPU X")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(rates_module, "measure", lambda device: DeviceRates("GPU X", 700.0, 2000.0))
    assert rates_module.device_rates(torch.device("cuda")).matmul_tflops == 700.0
    assert json.loads((tmp_path / rates_module.CACHE_FILE).read_text())["GPU X"]["copy_gbps"] == 2000.0


EFFICIENCY = ("train_tflops", "train_matmul_fraction", "scoring_tflops", "scoring_matmul_fraction",
              "training_half_floor_s", "generation_floor_s", "step_floor_s")


@pytest.mark.slow
def test_the_trainer_reports_efficiency_only_where_rates_are_measured(tmp_path, monkeypatch):
    from tests.test_trainer import FixedBackend, fixed_completions, make_trainer

    trainer = make_trainer(tmp_path / "cpu", beta=0.04)
    trainer.train()
    logged = [row for row in trainer.state.log_history if "loss" in row]
    assert not any(f"perf/{name}" in row for row in logged for name in EFFICIENCY)  # a CPU: absent, not zero
    assert not any(name in trainer.get_performance_stats() for name in EFFICIENCY)

    # the same run where the device's rates are known (1 TFLOP/s and 1 GB/s, so fractions equal the rates)
    monkeypatch.setattr("hf_grpo.trainer.device_rates", lambda device: DeviceRates("test", 1.0, 1.0))
    trainer = make_trainer(tmp_path / "rated", beta=0.04)
    seen = []  # the rollout's prompts, as the trainer tokenized them

    class RecordingBackend(FixedBackend):
        def generate(self, model, prompt_ids, **kwargs):
            seen.extend(prompt_ids)
            return super().generate(model, prompt_ids, **kwargs)

    trainer.decisions.backend = RecordingBackend()
    trainer.train()
    stats = trainer.get_performance_stats()
    assert all(stats[name] > 0 for name in EFFICIENCY)
    assert stats["train_matmul_fraction"] == pytest.approx(stats["train_tflops"])
    assert "decode_gbps" not in stats  # the hf backend does not time its decode loop
    # the step's work by hand: its 8 rows (2 prompts x 4 completions) scored once by the reference, trained once
    prompt_ids = seen
    assert len(prompt_ids) == 8
    completions = [len(c) for c in fixed_completions(prompt_ids)]
    batch = BatchTokens.count([len(p) for p in prompt_ids], completions, [i // 4 for i in range(8)])
    work = trainer.work.work
    expected = (work.forward_flops(batch.tokens, batch.pairs, batch.scored)
                + work.training_flops(batch.tokens, batch.pairs, batch.scored, recompute=False))
    assert stats["training_half_floor_s"] == pytest.approx(expected / 1e12)
    # the prefill, and each decode step's prompt reads: each of the two prompts once (its four rows share it)
    assert all(prompt_ids[i] == prompt_ids[i // 4 * 4] for i in range(8)) and prompt_ids[0] != prompt_ids[4]
    assert stats["generation_floor_s"] == pytest.approx(
        work.decode_bytes([len(p) for p in prompt_ids], completions, 8, [i // 4 for i in range(8)]) / 1e9
        + work.prefill_flops([len(prompt_ids[0]), len(prompt_ids[4])]) / 1e12)
