"""TRL's switches around a rollout (checkpointing off and on, a LoRA reference's adapters off), made quick: the
same rollout, the same log-probs, and every flag as it was after, without the walks over the model."""

import contextlib

import peft
import pytest
import torch
import transformers
from peft import LoraConfig, get_peft_model
from trl.models.utils import disable_gradient_checkpointing

from hf_grpo import GRPOConfig, GRPOTrainer
from hf_grpo.recipe_support.tiny import build_tiny_model
from hf_grpo.training import scoring_switches
from tests.test_trainer import TOKENIZER, FixedBackend, count_a_reward, prompt_dataset

LORA = dict(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)  # adapters that change outputs


def lora_model(**lora):
    return get_peft_model(build_tiny_model(TOKENIZER, seed=0, num_hidden_layers=4), LoraConfig(**{**LORA, **lora}))


def rollout_trainer(tmp_path, kind):
    """A new LoRA adapter (TRL scores its reference with the adapters off), an adapter loaded from its saved
    directory to train on (TRL copies it as the reference adapter "ref"), or a full fine-tune with a reference."""
    model = build_tiny_model(TOKENIZER, seed=0, num_hidden_layers=4)
    if kind == "saved_adapter":
        get_peft_model(build_tiny_model(TOKENIZER, seed=1, num_hidden_layers=4),
                       LoraConfig(**LORA)).save_pretrained(tmp_path / "adapter")
        model = peft.PeftModel.from_pretrained(model, tmp_path / "adapter", is_trainable=True)
    args = GRPOConfig(output_dir=str(tmp_path / kind), report_to=[], use_cpu=True, bf16=False, max_steps=1, beta=0.04,
                      per_device_train_batch_size=8, num_generations=4, max_completion_length=6,
                      save_strategy="no", disable_tqdm=True, activation_checkpointing=True)
    trainer = GRPOTrainer(model=model, reward_funcs=count_a_reward, args=args, train_dataset=prompt_dataset(),
                          processing_class=TOKENIZER, peft_config=LoraConfig(**LORA) if kind == "lora" else None)
    trainer.decisions.backend = FixedBackend()
    trainer.model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    trainer.model.train()
    return trainer


class Calls:
    """How often the slow switches' walks ran: PEFT's adapter status, transformers' checkpointing flags."""

    def __init__(self, monkeypatch):
        self.count = 0
        for owner, name in ((peft.PeftModel, "get_model_status"),
                            (transformers.PreTrainedModel, "_set_gradient_checkpointing")):
            original = getattr(owner, name)
            monkeypatch.setattr(owner, name, self.counted(original))

    def counted(self, original):
        def wrapper(*args, **kwargs):
            self.count += 1
            return original(*args, **kwargs)
        return wrapper


@pytest.mark.parametrize("kind", ["lora", "saved_adapter", "full"])
def test_a_rollout_scores_the_same_with_the_quick_switches_as_with_the_libraries_own(tmp_path, monkeypatch, kind):
    trainer = rollout_trainer(tmp_path, kind)
    rows = list(prompt_dataset(8))
    calls = Calls(monkeypatch)
    quick = trainer._generate_and_score_completions(rows)
    assert calls.count == 0, "a switch walked the model"
    if kind == "saved_adapter":  # TRL's reference there is its copy of the adapter, switched to by name
        assert "ref" in trainer.model.peft_config
    with monkeypatch.context() as patch:
        patch.setattr(scoring_switches, "installed", lambda *args: contextlib.nullcontext())
        own = trainer._generate_and_score_completions(rows)
    assert calls.count > 0
    assert quick.keys() == own.keys()
    for key, value in quick.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, own[key]), key
    # the reference was scored with the adapters off: the policy's own log-probs differ
    if kind == "lora":
        ids = torch.cat([quick["prompt_ids"], quick["completion_ids"]], dim=1)
        mask = torch.cat([quick["prompt_mask"], quick["completion_mask"]], dim=1)
        with torch.no_grad():
            policy, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, ids.shape[1] -
                                                                      quick["prompt_ids"].shape[1], batch_size=8)
        assert not torch.allclose(policy, quick["ref_per_token_logps"], atol=1e-3)
    assert "disable_adapter" not in vars(trainer.model) and "gradient_checkpointing_enable" not in vars(trainer.model)


def test_every_flag_is_as_it_was_after_the_switches_and_each_is_off_inside():
    model = lora_model()
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False}, every_n_layers=2)
    model.base_model.model.model.layers[0].self_attn.q_proj.lora_A["default"].weight.requires_grad_(False)  # frozen
    model.base_model.model.model.layers[1].mlp.up_proj.enable_adapters(False)  # one layer's adapters off already
    flags = lambda: [getattr(m, "gradient_checkpointing", None) for m in model.modules()]
    functions = lambda: [getattr(m, "_gradient_checkpointing_func", None) for m in model.modules()]
    adapters_off = lambda: [m.disable_adapters for m in model.modules() if isinstance(m, peft.tuners.lora.LoraLayer)]
    grads = lambda: {n: p.requires_grad for n, p in model.named_parameters()}
    before = (flags(), functions(), adapters_off(), grads())
    assert any(before[0]) and not all(f for f in before[0] if f is not None)  # every other layer checkpointed
    switches = scoring_switches.QuickSwitches(model, model)
    with switches.installed():
        with disable_gradient_checkpointing(model, {"use_reentrant": False}):  # TRL's around its scoring
            assert not any(flags())
            with model.disable_adapter():
                assert all(adapters_off())
            assert adapters_off() == before[2]
    assert (flags(), functions(), adapters_off(), grads()) == before
    assert not {"disable_adapter", "gradient_checkpointing_disable", "gradient_checkpointing_enable"} & set(vars(model))


def test_an_error_inside_leaves_the_flags_as_they_were():
    model = lora_model()
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    switches = scoring_switches.QuickSwitches(model, model)
    with pytest.raises(RuntimeError, match="mid-rollout"), switches.installed():
        model.gradient_checkpointing_disable()  # as TRL's generation context does, with no "on" reached
        raise RuntimeError("mid-rollout")
    assert model.is_activation_checkpointing
    assert all(layer.gradient_checkpointing for layer in model.base_model.model.model.layers)


def test_adapters_peft_switches_another_way_keep_peft_switch_and_a_switch_set_by_the_user_stays():
    assert scoring_switches.switchable_adapter_layers(lora_model(bias="lora_only")) is None  # PEFT warns there
    assert scoring_switches.switchable_adapter_layers(build_tiny_model(TOKENIZER, seed=0)) is None  # no PEFT
    model = lora_model()
    assert len(scoring_switches.switchable_adapter_layers(model)) == 4 * 7  # every linear layer of 4 layers
    users_own = contextlib.nullcontext
    model.disable_adapter = users_own
    with scoring_switches.QuickSwitches(model, model).installed():
        assert model.disable_adapter is users_own
    assert model.disable_adapter is users_own
