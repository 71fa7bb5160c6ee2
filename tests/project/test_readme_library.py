"""The README's library snippet ("Use it in your code"), run as a user runs it: saved to a script and started with
``accelerate launch --config_file accelerate_configs/zero2.yaml`` (the shipped config as is: bf16, DeepSpeed), here
on a CPU with two processes. tests/project/test_readme_commands.py runs the documented shell commands; this is its
Python.
"""

import json
import math
import os
import pathlib
import re

import pytest
from tests.launching import accelerate_command, run_launch
from tests.side_by_side import free_port

ROOT = pathlib.Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.launch]

# What the test changes in the snippet, each with its reason; every one must match exactly once.
SUBSTITUTIONS = [
    # offline: a checkpoint directory written here stands in for the hub model, a local GSM8K file for the hub set
    ('model="Qwen/Qwen2.5-0.5B-Instruct"', 'model="{checkpoint}"'),
    ('gsm8k_dataset("openai/gsm8k")', 'gsm8k_dataset("{data}")'),
    # short: two logged steps, completions a 2-core CPU generates in seconds, the output in tmp
    ('output_dir="outputs/qwen-gsm8k",', 'output_dir="{out}", max_steps=2, logging_steps=1, disable_tqdm=True,'),
    ("max_completion_length=512,", "max_completion_length=12,"),
]


def readme_snippet() -> str:
    readme = (ROOT / "README.md").read_text()
    return re.search(r"## Use it in your code\n\n```python\n(.*?)```", readme, re.S).group(1)


def test_the_library_snippet_runs_under_zero2_on_two_processes(tmp_path):
    from hf_grpo.recipe_support.tiny import save_tiny_checkpoint

    checkpoint = save_tiny_checkpoint(tmp_path / "checkpoint")
    data = tmp_path / "gsm8k.jsonl"
    questions = ["What is 3 + 4?", "Tom has 9 apples and eats 2 of them at lunch. How many are left?",
                 "7?", "A box holds 5 pens; Ann adds 2 more. How many pens?"] * 4
    data.write_text("".join(json.dumps({"question": q, "answer": "so\n#### 7"}) + "\n" for q in questions))
    out = tmp_path / "out"
    script = readme_snippet()
    for documented, stand_in in SUBSTITUTIONS:
        assert script.count(documented) == 1, f"the README snippet no longer has {documented!r}"
        script = script.replace(documented, stand_in.format(checkpoint=checkpoint, data=data, out=out))
    (tmp_path / "train.py").write_text(script)

    command = accelerate_command("--config_file", ROOT / "accelerate_configs" / "zero2.yaml",
                                 "--main_process_port", free_port(), tmp_path / "train.py", processes=2)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("DIFFU_", "WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_", "ACCELERATE_"))}
    result = run_launch(command, processes=2, timeout=900, cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-6000:]

    # the launch config's bf16 is turned off, and said, on a machine without a GPU
    assert "no CUDA device: training in fp32, not the launch config's mixed_precision=bf16" in result.stderr
    assert "rollout: 8 prompts x 8 generations = 64 completions (32 per device x 2 devices)" in result.stdout
    # the files docs/output_dirs.md lists for every run, written by the trainer (no recipe here)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2], rows
    assert all(math.isfinite(row["loss"]) and math.isfinite(row["reward"]) for row in rows), rows
    per_rank = json.loads((out / "performance.json").read_text())["per_rank"]
    assert len(per_rank) == 2 and all(rank["peak_memory_gib"] > 0 for rank in per_rank), per_rank
    assert (out / "model.safetensors").exists()  # trainer.save_model()
