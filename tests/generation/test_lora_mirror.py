"""LoRA rollouts from merged weights (``lora_generation_mirror``): a LoRA policy outside ZeRO-3 decodes from its own
weights with the adapters merged in place for the rollout and restored after (``generation.lora_merge``), instead
of running the adapters inside every decode step. What a user relies on: the choice ("auto" needs CUDA, "on"
forces it, models without LoRA are left alone); no second copy of the weights; the merged weights equal
``merge_and_unload``'s; the frozen base weights come back bit for bit after every rollout, also after a rollout
that raised; and a GRPO run from a saved checkpoint with LoRA generates from the merged weights, whose logits
equal the live PEFT policy's at every rollout, after optimizer steps have moved the adapters.
The GPU test checks greedy LoRA rollouts of the cuda_graph backend against the unmerged model, twice, the
captured graph reused after the adapters changed.
"""

from __future__ import annotations

import copy

import pytest
import torch
from datasets import Dataset
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

import hf_grpo
from hf_grpo.generation import dense_mirror
from hf_grpo.generation.fused_projections import projection_groups
from hf_grpo.generation.hf import HFGenerateBackend
from hf_grpo.generation.lora_merge import InPlaceLoraMerge
from hf_grpo.generation.packed_weights import adjacent
from hf_grpo.plan import BatchPlan
from hf_grpo.recipe_support.tiny import build_char_tokenizer, build_tiny_model, save_tiny_checkpoint

CPU = torch.device("cpu")


def _lora(model):
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]))


def _moved_lora(model, seed=1):
    """A LoRA policy whose adapters add something (B starts at zero: the merge would change nothing)."""
    policy = _lora(model)
    torch.manual_seed(seed)
    for name, param in policy.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.1)
    return policy


def _base_weights(policy) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in policy.named_parameters() if "lora_" not in n}


def test_merged_view_shares_the_policys_tensors_equals_merge_and_unload_and_restores_bit_for_bit():
    policy = _moved_lora(build_tiny_model(build_char_tokenizer()))
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    before, logits_before = _base_weights(policy), policy(input_ids=ids).logits.detach()
    reference = copy.deepcopy(policy).merge_and_unload()
    view = InPlaceLoraMerge(policy)
    policy_storage = {p.data_ptr() for p in policy.parameters()}
    assert view.nbytes == 0 and all(p.data_ptr() in policy_storage for p in view.module.parameters())
    assert view.host_nbytes > 0
    for _ in range(3):  # every rollout merges and restores; a graph captured on the view reads the same addresses
        merged = view.refresh(policy)
        assert merged is view.module and not any("lora" in n for n, _ in merged.named_parameters())
        for (name, got), (_, want) in zip(merged.state_dict().items(), reference.state_dict().items(), strict=True):
            assert torch.equal(got, want), name
        view.restore(overlap=True)  # on the CPU: at once, as without
        assert all(torch.equal(p, before[n]) for n, p in _base_weights(policy).items())
        assert torch.equal(policy(input_ids=ids).logits, logits_before)


def test_a_second_refresh_without_restore_does_not_merge_twice():
    policy = _moved_lora(build_tiny_model(build_char_tokenizer()))
    before, reference = _base_weights(policy), copy.deepcopy(policy).merge_and_unload()
    view = InPlaceLoraMerge(policy)
    view.refresh(policy)
    merged = view.refresh(policy)  # as after a rollout that raised before its restore
    assert all(torch.equal(a, b) for a, b in zip(merged.state_dict().values(), reference.state_dict().values()))
    view.restore()
    assert all(torch.equal(p, before[n]) for n, p in _base_weights(policy).items())


def test_choose_lora_leaves_models_without_lora_alone():
    model = build_tiny_model(build_char_tokenizer())
    assert dense_mirror.choose_lora("on", model, "auto", CPU, lambda v: v) is None


def test_choose_lora_off_auto_and_on():
    policy = _lora(build_tiny_model(build_char_tokenizer()))
    off = dense_mirror.choose_lora("off", policy, "auto", CPU, lambda v: v)
    assert off.mirror is None and off.reason == "lora_generation_mirror='off'" and off.kind == "LoRA"
    auto = dense_mirror.choose_lora("auto", policy, "auto", CPU, lambda v: v)  # the decoder it serves needs CUDA
    assert auto.mirror is None and "CUDA" in auto.reason
    on = dense_mirror.choose_lora("on", policy, "hf", CPU, lambda v: v)
    assert isinstance(on.mirror, InPlaceLoraMerge) and on.nbytes == 0
    assert "adapters merged into the policy's own weights" in str(on)
    plan = BatchPlan(per_device_train_batch_size=4, gradient_accumulation_steps=1, steps_per_generation=1,
                     num_generations=4, num_iterations=1, per_device_generation_batch_size=4,
                     tensor_batch_size=64, world_size=1, **on.plan_fields())
    assert "LoRA: decoded with the adapters merged into the weights in place" in str(plan)


def test_config_rejects_an_unknown_lora_mirror_setting(make_config):
    with pytest.raises(ValueError, match=r"lora_generation_mirror must be one of .*got 'yes'"):
        make_config(lora_generation_mirror="yes")


def _lora_trainer(tmp_path, checkpoint):
    tokenizer = AutoTokenizer.from_pretrained(checkpoint, padding_side="left")
    config = hf_grpo.GRPOConfig(
        output_dir=str(tmp_path / "out"), report_to=[], use_cpu=True, bf16=False, max_steps=3, seed=0,
        per_device_train_batch_size=4, gradient_accumulation_steps=1, num_generations=4, max_completion_length=4,
        learning_rate=0.05, logging_steps=1, save_strategy="no", disable_tqdm=True, generation_backend="hf",
        lora_generation_mirror="on", beta=0.04,  # with LoRA the reference is the policy with adapters disabled
    )
    return hf_grpo.GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(checkpoint), processing_class=tokenizer, args=config,
        reward_funcs=lambda completions, **kw: [float(sum(map(ord, c)) % 7) for c in completions],
        train_dataset=Dataset.from_dict({"prompt": ["ab>", "c>", "defgh>", "ij>"] * 4}),
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    )


def _checkpoint_weights(checkpoint) -> dict[str, torch.Tensor]:
    return dict(AutoModelForCausalLM.from_pretrained(checkpoint).state_dict())


def _assert_base_is_the_checkpoint(trainer, checkpoint):
    saved = _checkpoint_weights(checkpoint)
    live = trainer.model.get_base_model().state_dict()
    for name, tensor in saved.items():
        module, _, leaf = name.rpartition(".")
        key = name if name in live else f"{module}.base_layer.{leaf}"  # a LoRA-wrapped projection
        assert torch.equal(live[key], tensor), f"{name} drifted from the checkpoint"


def test_lora_run_from_a_checkpoint_generates_from_the_merged_weights(tmp_path, monkeypatch):
    checkpoint = save_tiny_checkpoint(tmp_path / "checkpoint")
    trainer = _lora_trainer(tmp_path, checkpoint)
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    rollouts = []  # per rollout: the merged weights' logits (checked against the live policy after the restore)
    gaps, lora_sizes = [], []
    generate, restore = HFGenerateBackend.generate, InPlaceLoraMerge.restore

    def checked_generate(self, model, prompt_ids, **kwargs):
        assert model is trainer.decisions.mirror.mirror.module, "the rollout did not decode from the merged weights"
        with torch.no_grad():
            rollouts.append(model(ids).logits)
        return generate(self, model, prompt_ids, **kwargs)

    def checked_restore(self, **kwargs):
        restore(self, **kwargs)
        if rollouts:  # the live policy (base weights back, adapters on) must compute what the rollout decoded from
            with torch.no_grad():
                gaps.append((rollouts.pop() - trainer.model(input_ids=ids).logits).abs().max().item())
            lora_sizes.append(max(p.abs().max().item() for n, p in trainer.model.named_parameters() if "lora_B" in n))

    monkeypatch.setattr(HFGenerateBackend, "generate", checked_generate)
    monkeypatch.setattr(InPlaceLoraMerge, "restore", checked_restore)
    trainer.train()
    assert len(gaps) == 3
    assert lora_sizes[0] == 0 and lora_sizes[-1] > 0, "the adapters never moved: the test would prove nothing"
    assert all(gap < 1e-5 for gap in gaps), gaps
    assert trainer.batch_plan().generation_mirror_kind == "LoRA"
    # the frozen q/k/v and gate/up weights were laid side by side for the decoder, and still train and restore
    mirror = trainer.decisions.mirror.mirror
    groups = projection_groups(mirror.module)  # per layer: q/k/v weights, their biases (Qwen2), gate/up weights
    assert mirror.packed_groups == len(groups) == 3 * trainer.model.config.num_hidden_layers
    assert all(adjacent(group) is not None for group in groups)
    _assert_base_is_the_checkpoint(trainer, checkpoint)  # three merges and restores, and the frozen base is as saved


def test_a_rollout_that_raises_leaves_the_base_weights_as_saved(tmp_path, monkeypatch):
    checkpoint = save_tiny_checkpoint(tmp_path / "checkpoint")
    trainer = _lora_trainer(tmp_path, checkpoint)
    for name, param in trainer.model.named_parameters():
        if "lora_B" in name:  # adapters that add something, so a merge left in place would show
            torch.nn.init.normal_(param, std=0.1)

    def failing_generate(self, model, prompt_ids, **kwargs):
        raise RuntimeError("the rollout failed")

    monkeypatch.setattr(HFGenerateBackend, "generate", failing_generate)
    with pytest.raises(RuntimeError, match="the rollout failed"):
        trainer.train()
    _assert_base_is_the_checkpoint(trainer, checkpoint)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_greedy_lora_rollouts_from_the_merged_weights_equal_the_unmerged_model():
    from hf_grpo.generation.cuda_graph import CudaGraphBackend

    tokenizer = build_char_tokenizer()
    policy = _moved_lora(build_tiny_model(tokenizer, dtype=torch.float32).cuda())
    choice = dense_mirror.choose_lora("on", policy, "cuda_graph", torch.device("cuda"), lambda v: v)
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12], [13]]
    greedy = dict(generation_config=policy.generation_config.__class__(do_sample=False, max_new_tokens=12),
                  chunk_size=len(prompts), pad_token_id=0, eos_token_ids=[1])
    backend = CudaGraphBackend()
    for seed in (1, 2):  # the second rollout replays the graph captured in the first, the adapters changed
        torch.manual_seed(seed)
        for name, param in policy.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(param, std=0.1)
        from_merged = backend.generate(choice.mirror.refresh(policy), prompts, **greedy)
        choice.mirror.restore()
        from_adapters = HFGenerateBackend().generate(policy, prompts, **greedy)
        assert from_merged == from_adapters
    assert backend.num_captures == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_an_overlapped_restore_is_waited_for_by_each_layer_of_the_next_forward():
    """The copies back run on a side stream, here held back behind a long matmul chain: the forward that follows
    still computes from the restored weights (each layer waits for its own), while a read outside the layers'
    forwards, made at once, still sees the merged ones (the test would see a forward that did not wait)."""
    policy = _moved_lora(build_tiny_model(build_char_tokenizer(), dtype=torch.float32).cuda())
    ids = torch.tensor([[5, 6, 7, 8, 9]], device="cuda")
    with torch.no_grad():
        logits_before = policy(input_ids=ids).logits
    before = _base_weights(policy)
    view = InPlaceLoraMerge(policy)
    for _ in range(2):
        view.refresh(policy)  # (the second one waits for the first restore's copies: settle)
        busy = torch.randn(4096, 4096, device="cuda")
        with torch.cuda.stream(view._layerwise._stream):  # hold the side stream back
            for _ in range(200):
                busy = busy @ busy / 64
        view.restore(overlap=True)
        assert view._layerwise.pending
        name = next(n for n in before if "q_proj" in n and n.endswith("weight"))
        early = dict(policy.named_parameters())[name].detach().clone()  # on the compute stream, without waiting
        with torch.no_grad():
            logits = policy(input_ids=ids).logits
        assert not view._layerwise.pending  # every layer's hook ran and removed itself
        torch.testing.assert_close(logits, logits_before, rtol=0, atol=0)
        assert not torch.equal(early, before[name]), "the copies were done before the forward: nothing was tested"
        view.settle()
        assert all(torch.equal(p, before[n]) for n, p in _base_weights(policy).items())


class _DeferredRestore:
    """A CPU stand-in for the side-stream restore whose copies have not run yet when the next forward starts: each
    layer's copies run in that layer's forward pre-hook, as the GPU's wait would order them. A forward that read a
    layer without its hook would compute from the merged weights."""

    def __init__(self, layers):
        self.layers, self.pending, self.copied = layers, {}, 0
        self._layer_of = {id(p): i for i, layer in enumerate(layers) for p in layer.parameters()}

    def copy(self, pairs):
        self.settle()
        for tensor, source in pairs:
            index = self._layer_of.get(id(tensor))
            if index is None:
                tensor.copy_(source)
            else:
                if index not in self.pending:
                    hook = self.layers[index].register_forward_pre_hook(lambda module, args, i=index: self._run(i))
                    self.pending[index] = (hook, [])
                self.pending[index][1].append((tensor, source))

    def _run(self, index):
        hook, copies = self.pending.pop(index)
        hook.remove()
        for tensor, source in copies:
            tensor.copy_(source)
        self.copied += 1

    def settle(self):
        for index in list(self.pending):
            self._run(index)


def test_a_restore_left_to_each_layers_next_forward_trains_as_one_done_at_once(tmp_path, monkeypatch):
    """The trainer's reference pass and policy forwards go through the hooked layers: a run whose restore is
    deferred to each layer's next forward trains to the same adapters, bit for bit, as one restored at once."""
    from hf_grpo.generation import lora_merge

    checkpoint = save_tiny_checkpoint(tmp_path / "checkpoint")
    adapters, deferred = {}, []
    for overlapped in (False, True):
        if overlapped:
            monkeypatch.setattr(lora_merge, "layerwise_restore", lambda base: deferred.append(
                _DeferredRestore(lora_merge.decoder_layers(base))) or deferred[-1])
        torch.manual_seed(0)
        trainer = _lora_trainer(tmp_path / str(overlapped), checkpoint)
        for name, param in trainer.model.named_parameters():
            if "lora_B" in name:  # adapters that add something: a forward reading merged weights would differ
                torch.nn.init.normal_(param, std=0.1)
        trainer.train()
        adapters[overlapped] = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_" in n}
    assert deferred and deferred[0].copied >= 3 * 2  # every rollout's restore ran in the layers' hooks
    for name, value in adapters[False].items():
        assert torch.equal(value, adapters[True][name]), name
