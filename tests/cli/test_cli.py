"""`hf-grpo plan` as a user runs it: its exit code and output (in this process, see tests/in_process.py; the
installed console script itself runs in test_console_script_is_installed)."""

import os
import subprocess
import sys

import pytest
from tests.in_process import run_hf_grpo

EXPECTED_TREE = """\
rollout: 64 prompts x 8 generations = 512 completions (64 per device x 8 devices)
├── generation: 64 per device in 8 chunks of 8 (per_device_generation_batch_size)
├── training: 4 micro-batches of 16 per device (per_device_train_batch_size)
│   └── optimizer step every 4 micro-batches: 16 x 4 x 8 devices = 512 completions
├── 1 optimizer step per rollout, 1 pass (num_iterations)
└── log-softmax in chunks of 1024 token rows (tensor_batch_size)
"""


def run_cli(*args, env=None):
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("DIFFU_")}
    full_env.update(env or {})
    return run_hf_grpo(args, env=full_env)


def test_plan_prints_the_tree_of_the_contract_example():
    result = run_cli(
        "plan", "--per_device_train_batch_size", "16", "--num_generations", "8",
        "--gradient_accumulation_steps", "4", "--steps_per_generation", "4",
        "--per_device_generation_batch_size", "8", "--num_processes", "8",
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == EXPECTED_TREE


def test_invalid_plan_exits_1_with_the_message():
    result = run_cli("plan", "--per_device_train_batch_size", "3", "--num_generations", "8")
    assert result.returncode == 1
    assert result.stdout == ""
    assert "nearest valid per_device_train_batch_size: 8" in result.stderr


def test_plan_reads_a_yaml_and_flags_override_it(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("per_device_train_batch_size: 4\nnum_generations: 4\nsteps_per_generation: 2\n"
                      "learning_rate: 1.0e-5\nmodel_name_or_path: some/model\n")
    result = run_cli("plan", "--config", str(config))
    assert result.returncode == 0, result.stderr
    assert "rollout: 2 prompts x 4 generations = 8 completions" in result.stdout
    result = run_cli("plan", "--config", str(config), "--num_processes", "2", "--per_device_generation_batch_size", "3")
    assert "8 per device in 3 chunks of 3 (the last of 2)" in result.stdout
    assert "(8 per device x 2 devices)" in result.stdout


def test_plan_rejects_unknown_yaml_keys(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("per_device_train_batch_size: 4\nnum_generation: 4\n")
    result = run_cli("plan", "--config", str(config))
    assert result.returncode == 1
    assert "unknown keys ['num_generation' (did you mean 'num_generations'?)]" in result.stderr


def test_plan_names_an_accelerate_config_given_as_the_recipe_config():
    zero2 = os.path.join(os.path.dirname(__file__), "..", "..", "accelerate_configs", "zero2.yaml")
    result = run_cli("plan", "--config", zero2)
    assert result.returncode == 1
    assert result.stdout == ""
    assert f"{zero2} is an Accelerate launch config" in result.stderr
    assert f"accelerate launch --config_file {zero2}" in result.stderr


@pytest.mark.parametrize("text", ["", "# only a comment\n"])
def test_plan_refuses_an_empty_config_naming_the_file(tmp_path, text):
    config = tmp_path / "run.yaml"
    config.write_text(text)
    result = run_cli("plan", "--config", str(config))
    assert result.returncode == 1
    assert result.stdout == ""  # not the default plan, as if the file had been read
    assert f"{config} is empty (no keys)" in result.stderr
    framework = run_cli("plan", "--from", "verl", "--config", str(config))
    assert framework.returncode == 1 and f"{config} is empty (no keys)" in framework.stderr


def test_plan_applies_env_overrides_and_presets():
    result = run_cli("plan", "--per_device_train_batch_size", "8", "--num_generations", "4", "--preset", "memory",
                     env={"DIFFU_TENSOR_BATCH_SIZE": "256"})
    assert result.returncode == 0, result.stderr
    assert "in 4 chunks of 2" in result.stdout
    assert "chunks of 256 token rows" in result.stdout
    bad = run_cli("plan", env={"DIFFU_BATCH_SIZE": "abc"})
    assert bad.returncode == 1 and "DIFFU_BATCH_SIZE='abc'" in bad.stderr


def test_plan_flag_at_the_default_beats_the_preset():
    result = run_cli("plan", "--per_device_train_batch_size", "8", "--num_generations", "4", "--preset", "memory",
                     "--tensor_batch_size", "1024")
    assert result.returncode == 0, result.stderr
    assert "chunks of 1024 token rows" in result.stdout  # the flag, though 1024 is also the field's default
    assert "in 4 chunks of 2" in result.stdout  # the preset still fills the generation chunk


@pytest.mark.parametrize("args, code", [(["frobnicate"], 2), ([], 2), (["--help"], 0)])
def test_usage(args, code):
    assert run_cli(*args).returncode == code


def test_console_script_is_installed():
    import shutil

    exe = shutil.which("hf-grpo") or str(__import__("pathlib").Path(sys.executable).with_name("hf-grpo"))
    result = subprocess.run([exe, "plan", "--per_device_train_batch_size", "8"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("rollout: 1 prompt x 8 generations")


@pytest.mark.parametrize("module", ["hf_grpo", "hf_grpo.cli"])
def test_python_dash_m_runs_the_command(module, monkeypatch, capsys):
    """``python -m MODULE plan ...`` as the interpreter runs it (``runpy``, which ``-m`` uses, with the command's
    argv), in this process: a subprocess paid ~10 s of imports each; test_console_script_is_installed starts one."""
    import runpy

    monkeypatch.setattr(sys, "argv", [module, "plan", "--per_device_train_batch_size", "8"])
    with pytest.raises(SystemExit) as exit_:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    out, err = capsys.readouterr()
    assert exit_.value.code == 0, err
    assert out.startswith("rollout: 1 prompt x 8 generations")


def test_plan_help_documents_from():
    result = run_cli("plan", "--help")
    assert result.returncode == 0, result.stderr
    assert "--from" in result.stdout and "verl" in result.stdout and "KEY=VALUE" in result.stdout


def test_a_yaml_syntax_error_is_one_line_naming_file_and_place(tmp_path):
    config = tmp_path / "bad.yaml"
    config.write_text("per_device_train_batch_size: [8\n")
    result = run_cli("plan", "--config", str(config))
    assert result.returncode == 1
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.startswith(f"error: {config} is not valid YAML at line 2, column 1: expected ',' or ']'")


@pytest.mark.parametrize("field", ["per_device_train_batch_size", "steps_per_generation"])
def test_an_invalid_size_is_one_error_not_also_the_fields_derived_from_it(field):
    result = run_cli("plan", f"--{field}", "0")
    assert result.returncode == 1
    assert result.stderr == f"error: Invalid batch sizes:\n  - {field} must be an integer >= 1, got 0\n"


def test_a_whitespace_env_value_adds_no_note_to_the_translated_plan():
    result = run_cli("plan", "--from", "verl", "data.train_batch_size=16", "actor_rollout_ref.rollout.n=8",
                     "actor_rollout_ref.actor.ppo_mini_batch_size=16",
                     "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8", env={"DIFFU_BATCH_SIZE": " "})
    assert result.returncode == 0, result.stderr
    assert "DIFFU_BATCH_SIZE" not in result.stdout


LONG_7B = ("plan", "--per_device_train_batch_size", "1", "--steps_per_generation", "8", "--gradient_accumulation_steps",
           "8", "--num_generations", "8", "--activation_checkpointing", "true", "--model_config", "7b",
           "--longest_prompt", "1024", "--lora_r", "16", "--device_memory_gib", "79.19")


def test_plan_with_a_model_config_says_the_longest_completion_that_fits_and_refuses_a_longer_one(tmp_path):
    from hf_grpo.memory import context_fit
    from hf_grpo.recipe_support.tiny import SHAPES

    dims = context_fit.ModelDims.from_config({**SHAPES["7b"], "model_type": "qwen2"})
    shape = context_fit.RunShape(prompt=1024, generation_rows=8, lora_rank=16)
    longest = context_fit.longest_completion(dims, shape, int(79.19 * 2**30))
    result = run_cli(*LONG_7B, "--max_completion_length", "65536")
    assert result.returncode == 0, result.stderr
    assert f"the longest completion these sizes fit on 79.19 GiB is {longest:,} tokens" in result.stdout
    assert "at max_completion_length=65,536 the peak is" in result.stdout
    result = run_cli(*LONG_7B, "--max_completion_length", str(longest + 1))
    assert result.returncode == 1
    assert "rollout: 1 prompt x 8 generations" in result.stdout  # the plan is printed, then the refusal
    assert f"lower max_completion_length to {longest:,} or less" in result.stderr
    # a config.json read as the model's dimensions
    config = tmp_path / "config.json"
    config.write_text('{"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, '
                      '"num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100}')
    result = run_cli("plan", "--model_config", str(tmp_path), "--device_memory_gib", "2")
    assert result.returncode == 0, result.stderr
    assert "memory: the longest completion" in result.stdout
    result = run_cli("plan", "--model_config", str(tmp_path / "missing.json"), "--device_memory_gib", "2")
    assert result.returncode == 1 and "not a readable config.json" in result.stderr
