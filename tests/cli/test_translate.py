"""`hf-grpo plan --from`: other frameworks' batch settings, translated to hf-grpo's per-device fields.

Each framework's worked example (docs/other_frameworks.md's) must give the stated flags, and the hf-grpo plan must
train on the same number of completions per optimizer step and make the same number of optimizer
steps per rollout as the source framework does, by that framework's own rules, computed here by hand.
"""

import itertools
import re
from fractions import Fraction
from pathlib import Path

import pytest

from hf_grpo.cli.main import main
from hf_grpo.cli.translate import TranslationError, parse_settings, translate

OTHER_FRAMEWORKS_PAGE = Path(__file__).resolve().parents[2] / "docs" / "other_frameworks.md"


def _example(framework, settings, world=None, num_generations=None, flags="", batch=0, steps=0, rollout=0):
    return pytest.param(framework, settings, world, num_generations, flags, batch, Fraction(steps), rollout,
                        id=framework)


# The worked examples of docs/other_frameworks.md. batch / steps / rollout: the source framework's own arithmetic.
EXAMPLES = [
    # SkyRL: policy_mini_batch_size counts prompts (validate_batch_sizes multiplies it by n_samples_per_prompt):
    # 64 prompts x 8 = 512 samples per optimizer step; 256 / 64 = 4 mini-batches; 256 x 8 = 2048 samples per step.
    _example("skyrl", ["trainer.train_batch_size=256", "generator.n_samples_per_prompt=8",
                       "trainer.policy_mini_batch_size=64", "trainer.micro_train_batch_size_per_gpu=4",
                       "trainer.update_epochs_per_batch=1", "trainer.placement.policy_num_gpus_per_node=8",
                       "generator.sampling_params.max_generate_length=1024"],
             flags="--per_device_train_batch_size 4 --gradient_accumulation_steps 16 --steps_per_generation 64 "
                   "--num_generations 8 --num_iterations 1 --max_completion_length 1024",
             batch=64 * 8, steps=256 // 64 * 1, rollout=256 * 8),
    # veRL: ppo_mini_batch_size counts prompts (x rollout.n): 128 x 8 = 1024 samples per step; 512 / 128 = 4 steps.
    _example("verl", ["data.train_batch_size=512", "actor_rollout_ref.rollout.n=8",
                      "actor_rollout_ref.actor.ppo_mini_batch_size=128",
                      "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8", "actor_rollout_ref.actor.ppo_epochs=1",
                      "trainer.n_gpus_per_node=8", "trainer.nnodes=1", "data.max_response_length=1024"],
             flags="--per_device_train_batch_size 8 --gradient_accumulation_steps 16 --steps_per_generation 64 "
                   "--num_generations 8 --num_iterations 1 --max_completion_length 1024",
             batch=128 * 8, steps=512 // 128 * 1, rollout=512 * 8),
    # OpenRLHF: train_batch_size counts samples: 256 per step; 128 prompts x 8 = 1024 samples = 4 steps.
    _example("openrlhf", ["rollout_batch_size=128", "n_samples_per_prompt=8", "train_batch_size=256",
                          "micro_train_batch_size=4", "micro_rollout_batch_size=32", "max_epochs=1",
                          "actor_num_gpus_per_node=8", "generate_max_len=1024"],
             flags="--per_device_train_batch_size 4 --gradient_accumulation_steps 8 --steps_per_generation 32 "
                   "--num_generations 8 --num_iterations 1 --per_device_generation_batch_size 32 "
                   "--max_completion_length 1024",
             batch=256, steps=128 * 8 // 256 * 1, rollout=128 * 8),
    # trlx: per process; batch_size 32 x 2 processes = 64 samples per step; 128 / 32 = 4 batches x 4 ppo_epochs.
    _example("trlx", ["train.batch_size=32", "train.minibatch_size=8", "method.num_rollouts=128",
                      "method.chunk_size=64", "method.ppo_epochs=4", "method.gen_kwargs.max_new_tokens=256"],
             world=2, num_generations=8,
             flags="--per_device_train_batch_size 8 --gradient_accumulation_steps 4 --steps_per_generation 16 "
                   "--num_generations 8 --num_iterations 4 --per_device_generation_batch_size 64 "
                   "--max_completion_length 256",
             batch=32 * 2, steps=128 // 32 * 4, rollout=128 * 2),
    # d1 (TRL 0.16): 8 x 2 x 2 = 32 completions per step; each generated batch serves num_iterations = 4 steps.
    _example("d1", ["per_device_train_batch_size=8", "gradient_accumulation_steps=2", "num_generations=8",
                    "num_iterations=4", "generation_batch_size=4", "max_completion_length=256", "block_length=32",
                    "diffusion_steps=128"],
             world=2,
             flags="--per_device_train_batch_size 8 --gradient_accumulation_steps 2 --num_generations 8 "
                   "--num_iterations 4 --per_device_generation_batch_size 4 --max_completion_length 256 "
                   "--block_length 32 --diffusion_steps 128",
             batch=8 * 2 * 2, steps=4, rollout=8 * 2 * 2),
]


@pytest.mark.parametrize("framework, settings, world, num_generations, flags, batch, steps, rollout", EXAMPLES)
def test_worked_example_keeps_the_source_arithmetic(framework, settings, world, num_generations, flags, batch, steps,
                                                    rollout):
    t = translate(framework, parse_settings(settings), world, num_generations)
    assert t.flags() == flags
    assert t.plan.global_batch_size == batch  # completions per optimizer step
    assert t.plan.optimizer_steps_per_rollout == steps
    assert t.plan.global_rollout == rollout


@pytest.fixture
def world_of(monkeypatch):
    """Build configs as on W processes: hf-grpo's and TRL's world size, without starting a process group."""
    import transformers

    import hf_grpo.config

    def set_world(size):
        monkeypatch.setattr(hf_grpo.config, "current_world_size", lambda: size)
        monkeypatch.setattr(transformers.TrainingArguments, "world_size", property(lambda self: size))

    return set_world


@pytest.mark.parametrize("framework, settings, world, num_generations, flags, batch, steps, rollout", EXAMPLES)
def test_worked_example_flags_build_a_valid_config_through_a_recipe(framework, settings, world, num_generations,
                                                                    flags, batch, steps, rollout, world_of, tmp_path):
    """The printed flags, pasted after a recipe on W processes, give a config whose plan is the translation's."""
    from hf_grpo import GRPOConfig
    from hf_grpo.diffusion import DiffuGRPOConfig
    from hf_grpo.recipe_support.launch import parse_recipe_args

    t = translate(framework, parse_settings(settings), world, num_generations)
    world_of(t.world_size)
    config_cls = DiffuGRPOConfig if framework == "d1" else GRPOConfig
    config, _, _ = parse_recipe_args({"output_dir": str(tmp_path), "report_to": "none"}, t.flags().split(),
                                     config_cls=config_cls)
    assert config.batch_plan(t.world_size) == t.plan
    assert config.generation_batch_size == rollout  # TRL's field: the global rollout
    assert all(getattr(config, name) == value for name, value in t.fields.items())


def test_prompt_counted_and_sample_counted_knobs_meet():
    """The same run said three ways: SkyRL and veRL count the mini-batch in prompts, OpenRLHF in samples."""
    skyrl = translate("skyrl", parse_settings([
        "train_batch_size=256", "n_samples_per_prompt=8", "policy_mini_batch_size=64",
        "micro_train_batch_size_per_gpu=4"]), 8)
    verl = translate("verl", parse_settings([
        "data.train_batch_size=256", "rollout.n=8", "ppo_mini_batch_size=64", "ppo_micro_batch_size_per_gpu=4"]), 8)
    openrlhf = translate("openrlhf", parse_settings([
        "rollout_batch_size=256", "n_samples_per_prompt=8", "train_batch_size=512", "micro_train_batch_size=4"]), 8)
    assert skyrl.fields == verl.fields == openrlhf.fields
    assert skyrl.plan.global_batch_size == 512 and skyrl.plan.optimizer_steps_per_rollout == 4


def test_skyrl_guide_example_in_skyrls_own_units():
    """1024 prompts x 5, mini-batch 256 prompts, 4 GPUs: SkyRL steps 4 times per batch on 1280 samples each
    (policy_mini_batch_size_per_gpu = 256 x 5 // 4 = 320 micro-batches of 1)."""
    t = translate("skyrl", {"train_batch_size": 1024, "n_samples_per_prompt": 5, "policy_mini_batch_size": 256,
                            "micro_train_batch_size_per_gpu": 1}, 4)
    assert (t.fields["gradient_accumulation_steps"], t.fields["steps_per_generation"]) == (320, 1280)
    assert t.plan.global_batch_size == 1280 and t.plan.optimizer_steps_per_rollout == 4


def test_verl_dynamic_batch_maps_to_a_token_budget():
    t = translate("verl", parse_settings([
        "data.train_batch_size=512", "rollout.n=8", "ppo_mini_batch_size=128", "ppo_micro_batch_size_per_gpu=8",
        "use_dynamic_bsz=true", "ppo_max_token_len_per_gpu=16384"]), 8)
    # one micro-batch = the GPU's whole mini-batch of 128 x 8 / 8 = 128 samples, cut by tokens, not by count
    assert t.fields["per_device_train_batch_size"] == 128 and t.fields["gradient_accumulation_steps"] == 1
    assert t.fields["max_tokens_per_micro_batch"] == 16384
    assert "--max_tokens_per_micro_batch 16384" in t.flags()
    assert any("max_tokens_per_micro_batch" in n for n in t.notes)
    assert any("ppo_micro_batch_size_per_gpu: ignored" in n for n in t.notes)
    assert t.plan.global_batch_size == 1024 and t.plan.optimizer_steps_per_rollout == 4
    assert "passes of at most 16384 padded tokens (max_tokens_per_micro_batch)" in str(t.plan)
    with pytest.raises(TranslationError, match="missing actor_rollout_ref.actor.ppo_max_token_len_per_gpu"):
        translate("verl", parse_settings(["data.train_batch_size=8", "rollout.n=8", "ppo_mini_batch_size=8",
                                          "use_dynamic_bsz=true"]))


def test_verl_dynamic_batch_builds_a_valid_config(world_of, tmp_path):
    from hf_grpo import GRPOConfig

    t = translate("verl", parse_settings([
        "data.train_batch_size=64", "rollout.n=8", "ppo_mini_batch_size=32", "use_dynamic_bsz=true",
        "ppo_max_token_len_per_gpu=4096", "data.max_response_length=512"]), 2)
    world_of(2)
    config = GRPOConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True, bf16=False, **t.fields)
    assert config.max_tokens_per_micro_batch == 4096
    assert config.batch_plan(2) == t.plan


def test_verl_deprecated_global_micro_batch_is_divided_by_the_gpus():
    t = translate("verl", parse_settings(["data.train_batch_size=64", "rollout.n=4", "ppo_mini_batch_size=32",
                                          "actor_rollout_ref.actor.ppo_micro_batch_size=16"]), 4)
    assert t.fields["per_device_train_batch_size"] == 4 and t.fields["gradient_accumulation_steps"] == 8


def test_trlx_collects_whole_chunks_and_says_so():
    t = translate("trlx", parse_settings(["batch_size=32", "num_rollouts=100", "chunk_size=64", "ppo_epochs=1"]),
                  1, 8)
    assert t.plan.rollout_per_device == 128  # two chunks of 64, as trlx's make_experience collects
    assert any("collects whole chunks, 128 per process" in n for n in t.notes)


def test_world_size_from_the_framework_keys_and_flag_must_agree():
    base = ["data.train_batch_size=64", "rollout.n=4", "ppo_mini_batch_size=32", "ppo_micro_batch_size_per_gpu=4"]
    assert translate("verl", parse_settings(base + ["trainer.nnodes=2", "trainer.n_gpus_per_node=4"])).world_size == 8
    assert translate("verl", parse_settings(base), 8).world_size == 8
    with pytest.raises(TranslationError, match=r"--num_processes 4 disagrees with trainer.nnodes x "
                                               r"trainer.n_gpus_per_node = 2 x 4 = 8"):
        translate("verl", parse_settings(base + ["trainer.nnodes=2", "trainer.n_gpus_per_node=4"]), 4)


# ---- errors ---------------------------------------------------------------------------------------------------

def _error(framework, pairs, world=None, num_generations=None) -> str:
    with pytest.raises(TranslationError) as err:
        translate(framework, parse_settings(pairs), world, num_generations)
    return str(err.value)


def test_unknown_key_is_named_with_the_valid_keys():
    message = _error("skyrl", ["train_batch_sise=8"])
    assert "skyrl: unknown key 'train_batch_sise'" in message
    assert "trainer.train_batch_size" in message and "trainer.micro_train_batch_size_per_gpu" in message


def test_non_integer_value_is_named():
    message = _error("verl", ["rollout.n=eight"])
    assert "actor_rollout_ref.rollout.n='eight' is not an integer" in message
    assert "use_dynamic_bsz='maybe' is not a boolean" in _error("verl", ["use_dynamic_bsz=maybe"])
    assert "must be >= 1" in _error("openrlhf", ["train_batch_size=0"])


def test_sizes_that_do_not_divide_name_both_values_and_a_fix():
    message = _error("verl", ["data.train_batch_size=512", "rollout.n=8", "ppo_mini_batch_size=100",
                              "ppo_micro_batch_size_per_gpu=8"])
    assert "data.train_batch_size = 512 is not a multiple of actor_rollout_ref.actor.ppo_mini_batch_size = 100" \
        in message
    assert ("nearest valid data.train_batch_size: 500 or 600; or actor_rollout_ref.actor.ppo_mini_batch_size: 64 or 128"
            in message)
    # the per-GPU mini-batch, 64 x 8 / 8 = 64 samples, in micro-batches of 6
    message = _error("skyrl", ["train_batch_size=256", "n_samples_per_prompt=8", "policy_mini_batch_size=64",
                               "micro_train_batch_size_per_gpu=6"], 8)
    assert "GPUs = 64 is not a multiple of trainer.micro_train_batch_size_per_gpu = 6" in message
    assert "nearest valid trainer.micro_train_batch_size_per_gpu: 4 or 8" in message
    message = _error("openrlhf", ["rollout_batch_size=100", "n_samples_per_prompt=4", "train_batch_size=256",
                                  "micro_train_batch_size=4"])
    assert "rollout_batch_size x n_samples_per_prompt = 400 is not a multiple of train_batch_size = 256" in message
    assert "nearest valid rollout_batch_size: 64 or 128; or train_batch_size: 200 or 400" in message
    # trlx: 100 rollouts in chunks of 8 collect 104 per process, not a multiple of batch_size 24
    message = _error("trlx", ["batch_size=24", "num_rollouts=100", "chunk_size=8", "ppo_epochs=1"], 1, 4)
    assert "collects per process = 104 is not a multiple of train.batch_size = 24" in message
    assert "nearest valid method.num_rollouts: 96 or 120; or train.batch_size: 13 or 26" in message
    message = _error("skyrl", ["train_batch_size=256", "n_samples_per_prompt=8", "policy_mini_batch_size=64",
                               "micro_train_batch_size_per_gpu=4"], 3)
    assert "= 512 is not a multiple of the number of GPUs = 3" in message and "nearest valid GPUs: 2 or 4" in message


def test_missing_and_groupless_settings_say_what_to_give():
    assert "missing data.train_batch_size" in _error("verl", ["rollout.n=8"])
    assert "needs at least 2 per prompt" in _error("skyrl", ["n_samples_per_prompt=1"])
    assert "Give --num_generations G (>= 2)" in _error("trlx", ["batch_size=8"])
    assert "--num_generations is for trlx only" in _error("verl", ["rollout.n=8"], num_generations=8)


def test_knobs_without_an_equivalent_are_refused_with_the_reason():
    message = _error("verl", ["actor_rollout_ref.actor.ulysses_sequence_parallel_size=2"])
    assert "no hf-grpo equivalent: hf-grpo has no sequence parallelism" in message
    assert "ring_attn_size=4 has no hf-grpo equivalent" in _error("openrlhf", ["ring_attn_size=4"])


def test_key_forms():
    assert "is ambiguous" in _error("verl", ["log_prob_micro_batch_size_per_gpu=4"])
    with pytest.raises(TranslationError, match="not KEY=VALUE"):
        parse_settings(["train_batch_size"])
    with pytest.raises(TranslationError, match="given twice"):
        parse_settings(["n=2", "n=4"])
    assert parse_settings(["+trainer.nnodes=1", "--max_epochs=2"]) == {"trainer.nnodes": "1", "max_epochs": "2"}


# ---- the command line ------------------------------------------------------------------------------------------

def test_cli_prints_flags_then_plan(capsys):
    code = main(["plan", "--from", "verl", "data.train_batch_size=512", "actor_rollout_ref.rollout.n=8",
                 "ppo_mini_batch_size=128", "ppo_micro_batch_size_per_gpu=8", "--num_processes", "8"])
    out = capsys.readouterr().out
    assert code == 0
    lines = out.splitlines()
    assert lines[0] == "hf-grpo flags (a recipe launched on 8 processes):"
    assert lines[1] == ("--per_device_train_batch_size 8 --gradient_accumulation_steps 16 --steps_per_generation 64 "
                        "--num_generations 8 --num_iterations 1")
    assert "rollout: 512 prompts x 8 generations = 4096 completions (512 per device x 8 devices)" in lines
    assert "├── 4 optimizer steps per rollout, 1 pass (num_iterations)" in lines
    assert lines[-1].startswith("checked against verl: 128 prompts x 8 samples = 1024 samples per optimizer step")


def test_cli_reads_openrlhf_style_flags(capsys):
    assert main(["plan", "--from", "openrlhf", "--rollout_batch_size=128", "--n_samples_per_prompt=8",
                 "--train_batch_size=256", "micro_train_batch_size=4", "--num_processes", "8"]) == 0
    assert capsys.readouterr().out.splitlines()[1] == (
        "--per_device_train_batch_size 4 --gradient_accumulation_steps 8 --steps_per_generation 32 "
        "--num_generations 8 --num_iterations 1")


def test_cli_reads_openrlhf_command_line_form(capsys):
    # OpenRLHF's own command line as pasted from its scripts: "--key value" pairs, bare switches, our own flags
    # in between; the switches are not batch settings and are listed as ignored.
    assert main(["plan", "--from", "openrlhf", "--rollout_batch_size", "128", "--n_samples_per_prompt", "8",
                 "--flash_attn", "--train_batch_size", "256", "--num_processes", "8", "--micro_train_batch_size", "4",
                 "--gradient_checkpointing"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1] == ("--per_device_train_batch_size 4 --gradient_accumulation_steps 8 --steps_per_generation 32 "
                      "--num_generations 8 --num_iterations 1")
    assert out[-1] == "note: not batch settings, ignored (2): flash_attn, gradient_checkpointing"
    # a switch that is a typo of a batch key is still an error with "did you mean"
    assert main(["plan", "--from", "openrlhf", "--rollout_batch_sise", "128", "--n_samples_per_prompt", "8",
                 "--train_batch_size", "256", "--micro_train_batch_size", "4"]) == 1
    assert "did you mean 'rollout_batch_size'?" in capsys.readouterr().err


def test_cli_reports_the_reason_and_exits_1(capsys):
    assert main(["plan", "--from=trlx", "batch_size=8", "num_rollouts=8", "chunk_size=8", "ppo_epochs=1"]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("error: trlx: PPO samples one completion per prompt")


def test_cli_mentions_env_overrides_that_would_change_the_plan(capsys, monkeypatch):
    monkeypatch.setenv("DIFFU_BATCH_SIZE", "4")
    main(["plan", "--from", "d1", "per_device_train_batch_size=4", "gradient_accumulation_steps=1",
          "num_generations=4"])
    assert "note: DIFFU_BATCH_SIZE=4 is set: at launch it overrides per_device_generation_batch_size" in \
        capsys.readouterr().out


def test_the_docs_show_one_worked_example_per_framework_with_these_flags():
    """docs/other_frameworks.md's `hf-grpo plan --from` examples are the ones above: same settings, same flags."""
    section = OTHER_FRAMEWORKS_PAGE.read_text()
    commands = re.findall(r"^hf-grpo plan --from (\S+) (.*)$", section, flags=re.MULTILINE)
    by_framework = {framework: rest.split() for framework, rest in commands}
    assert sorted(by_framework) == sorted(e.values[0] for e in EXAMPLES)
    for example in EXAMPLES:
        framework, settings, world, num_generations, flags = example.values[:5]
        words = by_framework[framework]
        given = [w for w in words if "=" in w]
        assert given == settings, framework
        options = dict(itertools.pairwise(words))
        assert options.get("--num_processes") == (None if world is None else str(world)), framework
        assert options.get("--num_generations") == (None if num_generations is None else str(num_generations))
        assert f"\n{flags}\n" in section, framework


# ---- a whole pasted config ----------------------------------------------------------------------------------

VERL_YAML = """\
data:
  train_batch_size: 64
  val_batch_size: null
  max_response_length: 256
actor_rollout_ref:
  model:
    path: Qwen/Qwen2.5-0.5B
  actor:
    strategy: fsdp
    ppo_mini_batch_size: 32
    ppo_micro_batch_size: null
    ppo_micro_batch_size_per_gpu: 4
    ppo_epochs: 1
    clip_ratio: 0.2
    optim:
      lr: 1.0e-6
  rollout:
    name: vllm
    n: 8
    log_prob_micro_batch_size: null
critic:
  ppo_mini_batch_size: 32
  ppo_micro_batch_size_per_gpu: 4
algorithm:
  adv_estimator: grpo
trainer:
  nnodes: 1
  n_gpus_per_node: 8
  total_epochs: 15
  logger: ['console', 'wandb']
"""


def test_a_whole_verl_config_translates_its_batch_keys_and_lists_the_others_once(tmp_path, capsys):
    config = tmp_path / "verl.yaml"
    config.write_text(VERL_YAML)
    assert main(["plan", "--from", "verl", "--config", str(config)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[1] == ("--per_device_train_batch_size 4 --gradient_accumulation_steps 8 "
                                   "--steps_per_generation 16 --num_generations 8 --num_iterations 1 "
                                   "--max_completion_length 256")
    ignored = [line for line in out.splitlines() if "not batch settings, ignored" in line]
    assert ignored == ["note: not batch settings, ignored (12): data.val_batch_size, actor_rollout_ref.model.path, "
                       "actor_rollout_ref.actor.strategy, actor_rollout_ref.actor.clip_ratio, "
                       "actor_rollout_ref.actor.optim.lr, actor_rollout_ref.rollout.name, "
                       "actor_rollout_ref.rollout.log_prob_micro_batch_size, critic.ppo_mini_batch_size, "
                       "critic.ppo_micro_batch_size_per_gpu, algorithm.adv_estimator, trainer.total_epochs, "
                       "trainer.logger"]


def alias_bomb(levels: int) -> str:
    """About 1 KB of YAML whose level i names level i-1 twice: 2**levels values once walked."""
    lines = ["l0: &l0 {x: 1, y: 2}"] + [f"l{i}: &l{i} {{p: *l{i - 1}, q: *l{i - 1}}}" for i in range(1, levels + 1)]
    return "\n".join(lines) + "\ndata:\n  train_batch_size: 8\n"


@pytest.mark.parametrize("text, refusal", [
    (alias_bomb(30), "holds more than 100000 values, each alias (*name) counted as the values it repeats"),
    ("data: &d\n  train_batch_size: 8\n  loop: *d\n", "an alias names the value that holds it"),
], ids=["alias bomb", "recursive alias"])
def test_a_pasted_config_whose_aliases_expand_without_bound_is_refused_at_once(tmp_path, capsys, text, refusal):
    import time

    config = tmp_path / "verl.yaml"
    config.write_text(text)
    start = time.perf_counter()
    assert main(["plan", "--from", "verl", "--config", str(config)]) == 1
    assert time.perf_counter() - start < 5  # refused while reading (unbounded: minutes and gigabytes)
    assert capsys.readouterr().err.startswith(f"error: {config}: {refusal}")


def test_a_pasted_config_with_a_few_aliases_reads_as_if_written_out(tmp_path, capsys):
    config = tmp_path / "verl.yaml"
    config.write_text(VERL_YAML.replace("critic:\n  ppo_mini_batch_size: 32\n  ppo_micro_batch_size_per_gpu: 4\n",
                                        "critic: *actor\n").replace("  actor:\n", "  actor: &actor\n"))
    assert main(["plan", "--from", "verl", "--config", str(config)]) == 0
    assert capsys.readouterr().out.splitlines()[1].startswith("--per_device_train_batch_size 4 ")


def test_pasted_key_value_settings_keep_their_non_batch_keys_out_of_the_way():
    translation = translate("skyrl", parse_settings([
        "trainer.train_batch_size=16", "generator.n_samples_per_prompt=4", "trainer.policy_mini_batch_size=16",
        "trainer.micro_train_batch_size_per_gpu=8", "trainer.eval_batch_size=1024", "trainer.policy.optimizer_config.lr=1e-6",
        "generator.backend=vllm"]))
    assert translation.fields["per_device_train_batch_size"] == 8
    assert translation.notes[-1] == ("not batch settings, ignored (3): trainer.eval_batch_size, "
                                     "trainer.policy.optimizer_config.lr, generator.backend")


@pytest.mark.parametrize("framework, typo, meant", [
    ("verl", "actor_rollout_ref.actor.ppo_mini_batch_sise=16", "actor_rollout_ref.actor.ppo_mini_batch_size"),
    ("skyrl", "train_batch_sise=8", "trainer.train_batch_size"),
    ("trlx", "method.num_rollout=128", "method.num_rollouts"),
    ("verl", "trainer.n_gpu_per_node=8", "trainer.n_gpus_per_node"),
])
def test_a_typo_of_a_batch_key_is_answered_with_did_you_mean(framework, typo, meant):
    message = _error(framework, [typo], num_generations=4 if framework == "trlx" else None)
    assert f"unknown key {typo.split('=')[0]!r}; did you mean {meant!r}?" in message


def test_a_yaml_key_given_again_on_the_command_line_is_overridden_not_doubled(tmp_path, capsys):
    config = tmp_path / "verl.yaml"
    config.write_text(VERL_YAML)
    assert main(["plan", "--from", "verl", "--config", str(config), "rollout.n=4"]) == 0
    assert "--num_generations 4" in capsys.readouterr().out.splitlines()[1]


@pytest.mark.parametrize("framework, key, settings", [
    ("verl", "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu",
     ["data.train_batch_size=16", "rollout.n=4", "ppo_mini_batch_size=16", "ppo_micro_batch_size_per_gpu=8"]),
    ("skyrl", "trainer.micro_forward_batch_size_per_gpu",
     ["trainer.train_batch_size=16", "generator.n_samples_per_prompt=4", "trainer.policy_mini_batch_size=16",
      "trainer.micro_train_batch_size_per_gpu=8"]),
], ids=["verl", "skyrl"])
def test_a_log_prob_micro_batch_is_answered_with_the_chunks_hf_grpo_scores_in(framework, key, settings):
    """The note, batch_sizes.md and other_frameworks.md say what scoring_rows does: 2P rows, P under "eager"."""
    from hf_grpo.memory.token_budget import SCORING_ROWS_PER_TRAINING_ROW, scoring_rows

    note = next(n for n in translate(framework, parse_settings([*settings, f"{key}=4"]), 2).notes if key in n)
    assert scoring_rows(8, 100, None, "sdpa") == SCORING_ROWS_PER_TRAINING_ROW * 8 == 16
    assert scoring_rows(8, 100, None, "eager") == 8
    assert f"chunks of {SCORING_ROWS_PER_TRAINING_ROW} x per_device_train_batch_size rows" in note, note
    assert '1 x under "eager" attention' in note, note
    for page in ("batch_sizes.md", "other_frameworks.md"):
        text = " ".join((Path(__file__).resolve().parents[2] / "docs" / page).read_text().split())
        assert f"chunks of {SCORING_ROWS_PER_TRAINING_ROW}P rows" in text, page
