"""Multi-process launches on CPU (2 processes over gloo) under every Accelerate config, as users run them."""

import json
import math
import os
import pathlib
import sys

import pytest
import torch
from tests.launching import accelerate_command, run_launch

ROOT = pathlib.Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def launch(config, script, *args, processes=2):
    """``accelerate launch`` with CPU overrides kept on the command line, out of the shipped configs."""
    command = accelerate_command("--config_file", ROOT / "accelerate_configs" / f"{config}.yaml",
                                 "--mixed_precision", "no", ROOT / script, *args, processes=processes)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DIFFU_", "WORLD_SIZE", "RANK", "LOCAL_RANK"))}
    result = run_launch(command, processes=processes, timeout=900, cwd=ROOT, env=env)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-6000:]
    return result


def python(script, *args):
    result = run_launch([sys.executable, str(ROOT / script), *map(str, args)], processes=1, timeout=900, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-6000:]
    return result


QUICK = ["--use_cpu", "true", "--bf16", "false", "--disable_tqdm", "true", "--logging_steps", "1",
         "--per_device_train_batch_size", "8"]
# conftest's zero2_quickstart_run (shared by test_fault_resume and test_zero_resume)
ZERO2_QUICKSTART_STEPS = 6
ZERO2_QUICKSTART = [*QUICK, "--save_steps", "2", "--save_total_limit", "10", "--max_steps", str(ZERO2_QUICKSTART_STEPS)]


# multi_gpu, zero2 and zero3 (and zero3_offload) are launched by tests/recipes/test_real_runs.py with the gsm8k recipe,
# which asserts the same there (the world-size-2 plan, two logged steps, performance.json of both ranks), and the
# two-node runs of tests/distributed/test_multi_node.py and tests/project/test_readme_commands.py launch the quickstart
# under multi_node_zero2: a launch per config, not one per config and recipe. Here, the configs launched nowhere else.
@pytest.mark.parametrize(
    "config, extra",
    [("zero1", []),
     ("zero3", ["--ds3_gather_for_generation", "false"])],  # generation without gathering the whole model
    ids=["zero1", "zero3-no-gather"],
)
@pytest.mark.launch
def test_quickstart_runs_under_each_config_with_two_processes(tmp_path, config, extra):
    result = launch(config, "recipes/quickstart.py", *QUICK, "--output_dir", tmp_path, "--max_steps", 2,
                    "--gradient_accumulation_steps", 2, *extra)
    assert "hf-grpo batch plan (world size 2)" in result.stderr
    assert "16 per device x 2 devices" in result.stderr
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(math.isfinite(r["loss"]) for r in rows)
    per_rank = json.loads((tmp_path / "performance.json").read_text())["per_rank"]
    assert len(per_rank) == 2 and all(rank["peak_memory_gib"] > 0 for rank in per_rank)


@pytest.mark.launch
@pytest.mark.parametrize("config", ["zero2", "zero3"])  # under ZeRO-3 the reference is partitioned as it loads
def test_tiny_model_with_a_reference_model_with_two_processes(tmp_path, monkeypatch, config):
    """--tiny builds the policy in code; with --beta each process loads the reference from its own copy of it,
    which is gone after the run."""
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setenv("TMPDIR", str(scratch))  # where each process puts its copy
    launch(config, "recipes/quickstart.py", *QUICK, "--output_dir", tmp_path / "out", "--max_steps", 2,
           "--beta", 0.04)
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(math.isfinite(r["kl"]) for r in rows), rows
    # step 1 samples from the policy as built: a reference of the same weights gives a KL of 0 (fp32 rounding)
    assert abs(rows[0]["kl"]) < 1e-6, rows[0]
    assert sorted(p.name for p in scratch.glob("hf_grpo_*")) == []  # no copy left behind
    per_rank = json.loads((tmp_path / "out" / "performance.json").read_text())["per_rank"]  # the trainer's
    assert len(per_rank) == 2 and all(rank["peak_memory_gib"] > 0 for rank in per_rank), per_rank


@pytest.mark.launch
def test_a_policy_loaded_before_the_trainer_trains_with_its_reference_under_zero3(tmp_path):
    """A user's script loads the checkpoint, then builds the trainer: TRL loads the reference from its path inside
    zero.Init, which needs DeepSpeed's communication layer up (on a CPU Accelerate leaves it down)."""
    from hf_grpo.recipe_support.tiny import save_tiny_checkpoint

    checkpoint = save_tiny_checkpoint(tmp_path / "checkpoint")
    launch("zero3", "tests/scripts/loaded_policy_train.py", checkpoint, tmp_path / "out")
    rows = json.loads((tmp_path / "out" / "logged.json").read_text())
    assert [r["step"] for r in rows] == [1, 2] and all(math.isfinite(r["kl"]) for r in rows), rows
    # step 1 samples from the policy as loaded: the reference, loaded from the same directory, gives a KL of 0
    assert abs(rows[0]["kl"]) < 1e-6, rows[0]


def _update(path, initial):
    params = torch.load(path)
    return torch.cat([(params[k] - initial[k]).flatten() for k in sorted(params)])


FIXED_ROLLOUT = "tests/scripts/fixed_rollout_train.py"


@pytest.fixture(scope="module")
def single_process_params(tmp_path_factory):
    """The one-process run every ZeRO stage is compared with: run once for the module."""
    out = tmp_path_factory.mktemp("single")
    python(FIXED_ROLLOUT, out, 8)  # one process, 8 completions per step
    return out / "params.pt"


@pytest.mark.launch
@pytest.mark.parametrize("config", ["zero2", "zero3"])
def test_zero_stages_match_a_single_process_run(tmp_path, config, single_process_params):
    from hf_grpo.recipe_support.tiny import build_char_tokenizer, build_tiny_model

    initial = {n: p.detach() for n, p in build_tiny_model(build_char_tokenizer(), seed=0).named_parameters()}
    launch(config, FIXED_ROLLOUT, tmp_path / config, 4)  # two processes, 4 each: the same global batch
    single = _update(single_process_params, initial)
    sharded = _update(tmp_path / config / "params.pt", initial)
    assert single.norm() > 0
    # fp32 on CPU; reductions in another order leave about 1e-7 relative (measured 2.5e-7)
    assert ((single - sharded).norm() / single.norm()).item() < 1e-5


def _final_state(output_dir):
    from safetensors.torch import load_file

    return load_file(output_dir / "model.safetensors")


# Under ZeRO-2 (2 processes), tests/checks/test_fault_resume.py resumes a run whose rank was killed and checks the same
# metrics and weights: one ZeRO-2 resume-exactness run is enough. Here one process: the recipe's main() with the
# command line's argv, in this process (three subprocesses paid ~10 s of imports each and checked nothing more).
def test_resume_continues_exactly(tmp_path):
    from tests.project_files import load_recipe

    quickstart = load_recipe("quickstart")
    common = [*QUICK, "--per_device_train_batch_size", 16, "--save_steps", 2]

    def run(output_dir, *extra):
        quickstart.main([str(arg) for arg in (*common, "--output_dir", output_dir, *extra)])

    # steps 1-2 before the checkpoint, 3-4 after it: the optimizer's moments, the scheduler, the data order and
    # the sampling RNG must all come back from checkpoint-2 for the weights and rewards of steps 3-4 to match
    run(tmp_path / "straight", "--max_steps", 4)
    run(tmp_path / "resumed", "--max_steps", 2)
    run(tmp_path / "resumed", "--max_steps", 4, "--resume_from_checkpoint", tmp_path / "resumed" / "checkpoint-2")
    straight, resumed = _final_state(tmp_path / "straight"), _final_state(tmp_path / "resumed")
    for name in straight:
        torch.testing.assert_close(resumed[name], straight[name], rtol=1e-6, atol=1e-7)
    lines = lambda d: [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]  # noqa: E731
    assert [r["step"] for r in lines(tmp_path / "resumed")] == [1, 2, 3, 4]
    assert [r["reward"] for r in lines(tmp_path / "resumed")] == [r["reward"] for r in lines(tmp_path / "straight")]


@pytest.mark.launch
def test_zero3_with_one_process_saves_mid_run_and_resumes_exactly(tmp_path):
    # One process under ZeRO-3 runs without DeepSpeed's gathering hooks (distributed.zero3_one_process), the
    # reference model's engine too (beta > 0). A save gathers the 16-bit weights and releases them after; the run
    # trains on past it, and a resume from that checkpoint ends with the same weights and rewards.
    common = [*QUICK, "--per_device_train_batch_size", 16, "--save_steps", 2, "--save_total_limit", 10,
              "--beta", 0.04]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    result = launch("zero3", "recipes/quickstart.py", *common, "--output_dir", straight, "--max_steps", 4,
                    processes=1)
    assert "gathering hooks removed" in result.stderr
    (resumed / "checkpoint-2").parent.mkdir()
    import shutil

    shutil.copytree(straight / "checkpoint-2", resumed / "checkpoint-2")
    launch("zero3", "recipes/quickstart.py", *common, "--output_dir", resumed, "--max_steps", 4,
           "--resume_from_checkpoint", resumed / "checkpoint-2", processes=1)
    want, got = _final_state(straight), _final_state(resumed)
    assert want.keys() == got.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-6, atol=1e-7)
    lines = lambda d: [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]  # noqa: E731
    assert [r["step"] for r in lines(straight)] == [1, 2, 3, 4] and [r["step"] for r in lines(resumed)] == [3, 4]
    assert [r["reward"] for r in lines(resumed)] == [r["reward"] for r in lines(straight)][2:]
    # step 1 samples from the policy as built: its reference, whole without its hooks, gives a KL of 0
    assert abs(lines(straight)[0]["kl"]) < 1e-6 and all(math.isfinite(r["kl"]) for r in lines(straight))
