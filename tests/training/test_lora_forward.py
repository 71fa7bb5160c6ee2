"""LoRA's fused forward (``lora_fused_forward``, ``hf_grpo.training.lora_forward``): each adapted projection as base +
scaling * B(A(x)) with the add inside one ``addmm``. What a user relies on: outputs and gradients equal PEFT's (to
rounding in float32, within bf16's under autocast), with dropout too; adapters disabled, merged or of another kind
(DoRA) behave exactly as PEFT's; a deep copy of the model computes with its own adapters; the trainer installs it
by default on a LoRA policy, leaves it off when asked, and never under ZeRO-3 or FSDP.
"""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model

from hf_grpo.recipe_support.tiny import build_char_tokenizer, build_tiny_model
from hf_grpo.training import lora_forward
from tests.tolerances import backward_terms, reordered

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def lora_policy(dtype=torch.float32, dropout=0.0, seed=0, **config):
    """A tiny LoRA policy whose adapters add something (PEFT starts B at zero)."""
    torch.manual_seed(seed)
    model = build_tiny_model(build_char_tokenizer()).to(dtype)
    policy = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=dropout,
                                              **config))
    for name, param in policy.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.2)
    return policy


def outputs_and_grads(policy, ids, seed=0, autocast=False):
    policy.zero_grad(set_to_none=True)
    torch.manual_seed(seed)  # the same dropout masks in both runs
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = policy(input_ids=ids).logits
    logits.float().logsumexp(-1).sum().backward()
    grads = {n: p.grad.detach().float().clone() for n, p in policy.named_parameters() if p.requires_grad}
    return logits.detach().float(), grads


def batch(rows=3, length=11, seed=1):
    return torch.randint(3, 50, (rows, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("dropout", [0.0, 0.3], ids=["no_dropout", "dropout"])
def test_fused_forward_equals_peft_in_float32_outputs_and_adapter_gradients(dropout):
    policy = lora_policy(dropout=dropout)
    policy.train()
    ids = batch()
    want_logits, want_grads = outputs_and_grads(policy, ids)
    assert lora_forward.install(policy) == 7 * policy.config.num_hidden_layers
    got_logits, got_grads = outputs_and_grads(policy, ids)
    assert torch.allclose(got_logits, want_logits, rtol=1e-5, atol=1e-5)
    assert got_grads.keys() == want_grads.keys() and len(got_grads) == 2 * 7 * policy.config.num_hidden_layers
    terms = backward_terms(policy.config, ids.numel())
    for name, grad in got_grads.items():  # the adapters' sums taken in another order than PEFT's
        assert torch.allclose(grad, want_grads[name], **reordered(want_grads[name], terms)), name


def test_fused_forward_takes_the_in_place_op_under_bf16_autocast_and_agrees_with_peft(monkeypatch):
    policy = lora_policy(dtype=torch.bfloat16)
    layer = policy.base_model.model.model.layers[0].self_attn.q_proj
    assert layer.lora_A["default"].weight.dtype == torch.float32  # PEFT's float32 adapters on a bf16 model
    ids = batch()
    want_logits, want_grads = outputs_and_grads(policy, ids, autocast=True)
    lora_forward.install(policy)
    calls = []
    op = lora_forward.lora_linear
    monkeypatch.setattr(lora_forward, "lora_linear", lambda *a: calls.append({t.dtype for t in a[:5] if t is not None})
                        or op(*a))
    got_logits, got_grads = outputs_and_grads(policy, ids, autocast=True)
    assert len(calls) == 7 * policy.config.num_hidden_layers  # every adapted projection fused
    assert all(dtypes == {torch.bfloat16} for dtypes in calls)  # cast as autocast casts a linear's inputs
    # one rounding fewer than PEFT's: equal within bf16's resolution, not bit for bit
    assert (got_logits - want_logits).abs().max() <= 0.05 * want_logits.abs().max()
    for name, grad in got_grads.items():
        assert grad.dtype == torch.float32 and torch.allclose(grad, want_grads[name], rtol=0.05, atol=0.05 * (
            want_grads[name].abs().max())), name


def test_bf16_inputs_without_autocast_keep_peft_s_forward_for_float32_adapters():
    policy = lora_policy(dtype=torch.bfloat16)
    ids = batch()
    want = policy(input_ids=ids).logits  # PEFT adds in float32 and casts back
    lora_forward.install(policy)
    assert torch.equal(policy(input_ids=ids).logits, want)


def test_disabled_or_merged_adapters_run_as_peft_s_forward():
    policy = lora_policy()
    ids = batch()
    lora_forward.install(policy)
    with policy.disable_adapter():
        disabled = policy(input_ids=ids).logits
    base = copy.deepcopy(policy)
    lora_forward.uninstall(base)
    with base.disable_adapter():
        assert torch.equal(disabled, base(input_ids=ids).logits)
    unmerged = policy(input_ids=ids).logits
    policy.merge_adapter()
    assert torch.allclose(policy(input_ids=ids).logits, unmerged, rtol=1e-5, atol=1e-5)
    policy.unmerge_adapter()


def test_dora_layers_keep_peft_s_forward():
    policy = lora_policy(use_dora=True)
    ids = batch()
    want = policy(input_ids=ids).logits
    installed = lora_forward.install(policy)
    assert installed == 7 * policy.config.num_hidden_layers  # installed, and every call goes to PEFT's DoRA path
    assert torch.equal(policy(input_ids=ids).logits, want)


def test_a_deep_copy_computes_with_its_own_adapters_and_uninstall_gives_peft_s_forward_back():
    policy = lora_policy()
    ids = batch()
    lora_forward.install(policy)
    twin = copy.deepcopy(policy)
    before = policy(input_ids=ids).logits.detach()
    with torch.no_grad():
        for name, param in twin.named_parameters():
            if "lora_B" in name:
                param.zero_()
    assert torch.equal(policy(input_ids=ids).logits, before)  # the original's layers read their own adapters
    with policy.disable_adapter():
        base = policy(input_ids=ids).logits
    assert torch.allclose(twin(input_ids=ids).logits, base, rtol=1e-6, atol=1e-6)
    lora_forward.uninstall(policy)
    layer = policy.base_model.model.model.layers[0].mlp.down_proj
    assert "forward" not in vars(layer) and not hasattr(layer, lora_forward.INSTALLED)
    assert torch.allclose(policy(input_ids=ids).logits, before, rtol=1e-5, atol=1e-5)


def test_sharded_parameters_keep_peft_s_forward():
    # The trainer installs the fused forward only where facts.sharding is None (hf_grpo/trainer.py); its facts take
    # ZeRO-3 from the DeepSpeed config's stage.
    from hf_grpo.distributed.zero3_leaves import is_zero3_config
    from hf_grpo.run_state import RunFacts

    def sharding(fsdp=False, stage=None):
        config = None if stage is None else {"zero_optimization": {"stage": stage}}
        return RunFacts(deepspeed=stage is not None, zero3=is_zero3_config(config), fsdp=fsdp).sharding

    assert sharding() is None
    assert sharding(stage=2) is None
    assert sharding(stage=3) == "ZeRO-3"
    assert sharding(fsdp=True) == "FSDP"


def test_a_lora_grpo_step_with_the_fused_forward_updates_as_peft_s(tmp_path):
    from tests.test_trainer import TOKENIZER, FixedBackend, count_a_reward, prompt_dataset, train_one_step

    from hf_grpo import GRPOConfig, GRPOTrainer

    def trainer(on: bool):
        args = GRPOConfig(output_dir=str(tmp_path / str(on)), report_to=[], use_cpu=True, bf16=False, max_steps=1,
                          per_device_train_batch_size=8, num_generations=4, max_completion_length=6,
                          learning_rate=0.5, optim="sgd", save_strategy="no", disable_tqdm=True, logging_steps=1,
                          activation_checkpointing=False, lora_fused_forward=on, seed=3)
        made = GRPOTrainer(model=build_tiny_model(TOKENIZER, seed=0), reward_funcs=count_a_reward, args=args,
                           train_dataset=prompt_dataset(), processing_class=TOKENIZER,
                           peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False))
        made.decisions.backend = FixedBackend()
        return made

    peft_trainer = trainer(False)
    assert peft_trainer.decisions.lora_fused_layers == 0
    want_loss, want_update = train_one_step(peft_trainer)
    fused_trainer = trainer(True)
    assert fused_trainer.decisions.lora_fused_layers == 7 * fused_trainer.model.config.num_hidden_layers
    loss, update = train_one_step(fused_trainer)
    assert loss == pytest.approx(want_loss, rel=1e-5, abs=1e-6)
    assert any(delta.abs().max() > 0 for name, delta in update.items() if "lora_" in name)
    for name, delta in update.items():
        assert torch.allclose(delta, want_update[name], rtol=1e-4, atol=1e-6), name


def test_compiled_training_layers_run_the_fused_forward_as_eager_peft():
    from tests.training.test_training_compile import batch, forward_backward

    from hf_grpo.logprob_head import install_chunked_lm_head
    from hf_grpo.training.compiled_layers import CompiledTrainingLayers

    torch._dynamo.reset()
    eager = lora_policy()
    eager.get_base_model().activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    eager.train()
    compiled = copy.deepcopy(eager)
    for model in (eager, compiled):
        install_chunked_lm_head(model.get_base_model(), temperature=1.0, chunk_rows=7, return_entropy=True)
    lora_forward.install(compiled)
    layers = CompiledTrainingLayers(backend="aot_eager_decomp_partition")
    for seed, shape in enumerate([(4, 6, 5), (3, 9, 4)]):
        inputs = batch(*shape, seed=seed)
        want_logps, want_grads = forward_backward(eager, *inputs)
        with layers.route(compiled.get_base_model()):
            logps, grads = forward_backward(compiled, *inputs)
        assert layers.compiles > 0
        torch.testing.assert_close(logps, want_logps, rtol=1e-5, atol=1e-6)
        assert grads.keys() == want_grads.keys() and any("lora_B" in name for name in grads)
        terms = backward_terms(eager.config, inputs[0].numel())
        for name, grad in want_grads.items():  # compiled kernels sum in other orders than eager PEFT
            torch.testing.assert_close(grads[name], grad, **reordered(grad, terms), msg=name)


def test_the_adapter_is_added_into_the_base_output_in_place():
    # The point of the op: no copy of the base output before the add (torch.addmm(out, ...) made one per projection).
    x, weight, down, up = torch.randn(2, 5, 8), torch.randn(6, 8), torch.randn(2, 5, 3), torch.randn(6, 3)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = lora_forward.lora_linear(x, weight, None, down, up, 0.5)
    names = {event.key for event in prof.key_averages()}
    assert "aten::addmm_" in names and "aten::copy_" not in names, names
    torch.testing.assert_close(out, x @ weight.t() + 0.5 * down @ up.t())
