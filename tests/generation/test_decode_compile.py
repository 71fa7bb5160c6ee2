"""compile_generation: the decode step compiled where the run decodes enough steps to repay the compile."""

import logging

import pytest
from datasets import Dataset

from hf_grpo import GRPOConfig, GRPOTrainer
from hf_grpo.generation import HFGenerateBackend, decode_compile, open_backend
from hf_grpo.recipe_support.tiny import build_char_tokenizer, build_tiny_model

TOKENIZER = build_char_tokenizer()


@pytest.mark.parametrize("steps, accumulation, per_generation, iterations, rollouts", [
    (10, 4, 4, 1, 10),  # a rollout every optimizer step
    (10, 4, 4, 2, 5),  # num_iterations 2: each rollout trained on twice
    (10, 1, 4, 1, 3),  # a rollout every 4 steps; the run's last one started in step 9
    (7, 3, 2, 1, 11),  # rollouts that straddle optimizer steps: 21 micro-batches, one every 2
])
def test_a_runs_rollouts_follow_trls_generation_schedule(steps, accumulation, per_generation, iterations, rollouts):
    assert decode_compile.planned_rollouts(steps, accumulation, per_generation, iterations) == rollouts


def test_auto_compiles_from_the_break_even_number_of_decode_steps():
    threshold = decode_compile.AUTO_MIN_DECODE_STEPS
    assert decode_compile.choose("auto", threshold)[0] is None  # the backend's default: compile where torch can
    compile, why = decode_compile.choose("auto", threshold - 1)
    assert compile is False and f"at most {threshold - 1}" in why and "'on' compiles" in why
    assert decode_compile.choose("auto", None)[0] is None  # a run of unknown length is taken to be long
    assert decode_compile.choose("on", 1)[0] is True
    assert decode_compile.choose("off", 10**9)[0] is False


def test_a_bad_setting_is_refused_with_the_field_and_the_choices(tmp_path):
    with pytest.raises(ValueError, match=r"compile_generation must be one of \('auto', 'on', 'off'\), got 'fast'"):
        GRPOConfig(output_dir=str(tmp_path), use_cpu=True, compile_generation="fast")


class StandIn(HFGenerateBackend):
    """The cuda_graph backend's name and compile switch on a CPU: the run's decision is what it is told and logs."""

    name = "cuda_graph"
    compile = True  # the backend's own default where torch can compile


def short_run(tmp_path, setting: str) -> GRPOTrainer:
    """A trainer for a model saved in a directory (as a hub download is), for 2 steps of 2 micro-batches: a rollout
    every 2 (TRL's steps_per_generation defaults to the accumulation), 2 rollouts of at most 4 tokens: 8 decode
    steps."""
    build_tiny_model(TOKENIZER, seed=0).save_pretrained(tmp_path / "checkpoint")
    args = GRPOConfig(output_dir=str(tmp_path / "run"), report_to=[], use_cpu=True, max_steps=2, num_generations=4,
                      per_device_train_batch_size=4, gradient_accumulation_steps=2, max_completion_length=4,
                      compile_generation=setting, disable_tqdm=True, save_strategy="no")
    return GRPOTrainer(model=str(tmp_path / "checkpoint"), processing_class=TOKENIZER, args=args,
                       reward_funcs=lambda completions, **_: [0.0] * len(completions),
                       train_dataset=Dataset.from_dict({"prompt": ["ab>", "cd>"] * 4}))


# short_run decodes at most 8 steps: with the threshold lowered to 8 "auto" compiles
@pytest.mark.parametrize("setting, threshold, compile", [("auto", None, False), ("on", None, True), ("auto", 8, None)])
def test_the_trainer_opens_its_backend_with_the_runs_choice(monkeypatch, tmp_path, caplog, setting, threshold,
                                                            compile):
    opened = []

    def resolve_backend(name, model):
        opened.append(StandIn())
        return opened[-1], None

    monkeypatch.setattr("hf_grpo.generation.resolve_backend", resolve_backend)
    if threshold is not None:
        monkeypatch.setattr(decode_compile, "AUTO_MIN_DECODE_STEPS", threshold)
    trainer = short_run(tmp_path, setting)
    with caplog.at_level(logging.INFO, logger="hf_grpo"):
        trainer.train()
    assert trainer.decisions.decode_compile == decode_compile.choose(setting, 8)
    assert len(opened) == 1 and opened[0].compile is (compile is not False)  # one backend for the run
    logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith("generation backend:")]
    said = "captured eager" if compile is False else "compiled"
    assert logged == [f"generation backend: cuda_graph; decode step {said} ({decode_compile.choose(setting, 8)[1]})"]


def test_a_backend_that_compiles_nothing_logs_no_decode_step(caplog):
    with caplog.at_level(logging.INFO, logger="hf_grpo"):
        open_backend("hf", build_tiny_model(TOKENIZER, seed=0), None, True, decode_compile.choose("auto", 8))
    assert [r.getMessage() for r in caplog.records] == ["generation backend: hf"]


@pytest.mark.parametrize("setting, compiles", [("auto", False), ("on", True)])
def test_a_backend_the_size_probes_opened_gets_the_runs_choice(tmp_path, caplog, setting, compiles):
    # "auto" sizes on a GPU probe with the run's backend before train begin, so it is open before the run's length
    # is known: a run too short for the compile must still not compile (this one decodes 8 steps)
    trainer = short_run(tmp_path, setting)
    opened = trainer.decisions.backend = StandIn()
    with caplog.at_level(logging.INFO, logger="hf_grpo"):
        trainer.train()
    assert trainer.decisions.backend is opened and opened.compile is compiles
    said = "captured eager" if not compiles else "compiled"
    assert f"generation backend: cuda_graph; decode step {said} (" in caplog.text
