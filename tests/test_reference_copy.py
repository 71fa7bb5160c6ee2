"""A policy built in code with beta > 0: TRL's reference model is loaded from a private copy of its initial weights."""

import tempfile

import torch

from hf_grpo.recipe_support.tiny import build_tiny_model
from tests.test_trainer import TOKENIZER, make_trainer


def test_in_code_model_trains_with_a_reference_of_its_initial_weights(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))  # where the copy goes: checked for leftovers
    (tmp_path / "tmp").mkdir()
    model = build_tiny_model(TOKENIZER, seed=0)
    assert model.config._name_or_path == ""  # built in code: nothing TRL could load a reference from
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}
    # sampled completions (not the fixed ones), so the steps' rollouts come from the policy as it moves
    trainer = make_trainer(tmp_path, model=model, fixed=False, beta=0.04, max_steps=3, learning_rate=0.05)

    assert list((tmp_path / "tmp").iterdir()) == []  # the copy is gone once the trainer is built
    assert model.config._name_or_path == ""  # and the policy does not point at it
    reference = trainer.accelerator.unwrap_model(trainer.ref_model)
    assert reference is not model
    trainer.train()

    rows = [row for row in trainer.state.log_history if "loss" in row]
    assert len(rows) == 3 and all("kl" in row for row in rows), rows
    # step 1 scores with the policy as built: against a reference of the same weights the KL is 0 (fp32 rounding)
    assert abs(rows[0]["kl"]) < 1e-6, rows[0]
    # later steps score a policy that moved away from the frozen reference
    assert rows[-1]["kl"] > 1e-5, rows
    for name, parameter in reference.named_parameters():
        assert torch.equal(parameter, initial[name]), f"the reference's {name} is not the policy's initial weight"
    moved = sum((p.detach() - initial[n]).abs().sum().item() for n, p in trainer.model.named_parameters())
    assert moved > 0, "the policy did not train: the KL check above would compare equal weights"


def test_a_model_with_a_path_or_lora_or_beta_0_gets_no_copy(tmp_path, monkeypatch):
    """TRL's own paths stay as they are: a model loaded from a directory, beta=0, a LoRA policy."""
    from hf_grpo import reference_copy

    model = build_tiny_model(TOKENIZER, seed=0)
    assert reference_copy.needs_copy(model, 0.04, None)
    assert not reference_copy.needs_copy(model, 0.0, None)
    assert not reference_copy.needs_copy(model, 0.04, object())  # a peft_config: the reference is the base model
    assert not reference_copy.needs_copy("some/model", 0.04, None)
    model.config._name_or_path = str(tmp_path)
    assert not reference_copy.needs_copy(model, 0.04, None)
