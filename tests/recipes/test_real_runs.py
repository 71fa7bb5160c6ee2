"""The shipped recipes run as users run them, on a pretrained checkpoint directory (not ``--tiny``).

One process (``python recipes/X.py ARGS``, run as the recipe's ``main(ARGS)`` in this process) or two over
gloo (``accelerate launch --config_file accelerate_configs/<cfg>.yaml``, the shipped config untouched: it says
``mixed_precision: bf16``, and on this CPU machine the recipe must say so and train in fp32), with and without a reference model
(beta), full fine-tuning and LoRA. Each run trains 2 steps of GSM8K from a local JSON-lines file whose
questions are of clearly different lengths (so prompts are padded inside a batch), then the saved
model must reload and differ from the checkpoint it started from.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import subprocess

import pytest
import torch
from tests.in_process import run_recipe
from tests.launching import accelerate_command, run_launch
from tests.side_by_side import free_port

ROOT = pathlib.Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow

FP32_WARNING = "no CUDA device: training in fp32, not the launch config's mixed_precision=bf16"
# What a user passes to keep a run tiny; everything else (bf16, use_cpu, the launch config) is left as shipped.
# 8 completions per device = 2 prompts x 4 generations: prompts of different lengths are padded together on
# every rank (the rollout, 8 x world size, is a whole number of groups of 4: README "Batch sizes").
SMALL = ["--max_steps", 2, "--max_completion_length", 12, "--per_device_train_batch_size", 8, "--num_generations", 4,
         "--logging_steps", 1, "--save_strategy", "no", "--disable_tqdm", "true", "--report_to", "none"]
LORA = ["--use_peft", "true", "--lora_r", 8, "--lora_alpha", 16]


# ---- the checkpoint and the data ---------------------------------------------------------------

def _questions() -> list[dict]:
    """GSM8K-style rows whose questions run from 10 to 150 printable characters; answers 7 or 3."""
    text = ("Tom has some red apples and a few green pears in a basket by the door; he gives two of them to "
            "Ann, eats one at lunch and sells the rest at the market. How many does he keep for himself at")
    lengths = [10, 150, 24, 128, 41, 97, 63, 12, 140, 75, 33, 110]
    rows = []
    for index, length in enumerate(lengths):
        question = text[: length - 1].rstrip() + "?"
        assert len(question) >= 10 and question.isprintable() and question.isascii()
        answer = 7 if index % 2 == 0 else 3
        rows.append({"question": question, "answer": f"He keeps what is left.\n#### {answer}"})
    return rows


PRETRAIN_STEPS, PRETRAIN_LR = 15, 1e-2  # ~5 s; leaves "7" and "3" about equally likely after every prompt


def _pretrain_to_answer_briefly(directory: str, questions: list[str]) -> None:
    """A few supervised steps so the checkpoint answers GSM8K prompts with a short number, 7 or 3.

    A freshly initialised model samples ~100 byte tokens near uniformly, so the correctness reward is
    0 for every completion of a 2-step run, the advantages are 0 and nothing trains: the "weights
    changed" checks below would fail for no fault of the trainer. Like a real instruct checkpoint, this
    one already answers in a gradable shape and is right about half the time, so reward groups mix
    right and wrong answers. Written back with ``save_pretrained``: the directory stays hub-like.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_grpo.recipe_support.tasks import as_chat, gsm8k_prompt

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(directory)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    sequences = []
    for question in questions:
        prompt = tokenizer.apply_chat_template(as_chat(gsm8k_prompt(question)), tokenize=False,
                                               add_generation_prompt=True)
        prompt_ids = tokenizer(prompt)["input_ids"]
        for target in ("7", "3", "so 7", "it is 3"):
            target_ids = tokenizer(target)["input_ids"] + [tokenizer.eos_token_id]
            sequences.append((prompt_ids + target_ids, [-100] * len(prompt_ids) + target_ids))
    width = max(len(ids) for ids, _ in sequences)
    pad = lambda row, value: [value] * (width - len(row)) + row  # noqa: E731 (left padding)
    input_ids = torch.tensor([pad(ids, tokenizer.pad_token_id) for ids, _ in sequences])
    labels = torch.tensor([pad(lab, -100) for _, lab in sequences])
    attention_mask = torch.tensor([pad([1] * len(ids), 0) for ids, _ in sequences])
    optimizer = torch.optim.Adam(model.parameters(), lr=PRETRAIN_LR)
    for _ in range(PRETRAIN_STEPS):
        model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.save_pretrained(directory)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(checkpoint directory, GSM8K .jsonl file): a hub-like directory written once for the module."""
    from hf_grpo.recipe_support.tiny import save_tiny_checkpoint

    base = tmp_path_factory.mktemp("real_runs")
    rows = _questions()
    data = base / "gsm8k.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    directory = save_tiny_checkpoint(base / "checkpoint")
    _pretrain_to_answer_briefly(directory, [row["question"] for row in rows[::6]])
    return directory, data


def _weights(directory, name: str = "model.safetensors") -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(os.path.join(directory, name))


# ---- running a recipe --------------------------------------------------------------------------

def _clean_env() -> dict[str, str]:
    """The caller's environment without batch overrides, a launcher's rank variables or Accelerate settings."""
    dropped = ("DIFFU_", "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
               "ACCELERATE_")
    return {k: v for k, v in os.environ.items() if not k.startswith(dropped)}


def _command(launch: str, recipe: str, args) -> list[str]:
    """The shipped config as is (bf16, 8 processes): only the process count and a free port on the command line."""
    return accelerate_command("--config_file", ROOT / "accelerate_configs" / f"{launch}.yaml",
                              "--main_process_port", free_port(), ROOT / "recipes" / f"{recipe}.py", *args,
                              processes=2)


def _run(launch: str | None, recipe: str, *args, timeout: int = 300) -> subprocess.CompletedProcess:
    if launch is None:  # python recipes/RECIPE.py ARGS, in this process (tests/in_process.py)
        return run_recipe(recipe, args, env=_clean_env(), cwd=ROOT)
    return run_launch(_command(launch, recipe, args), processes=2, timeout=timeout, cwd=ROOT, env=_clean_env())


def _ok(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert result.returncode == 0, (f"exit code {result.returncode}\n--- stdout (tail) ---\n{result.stdout[-2000:]}"
                                    f"\n--- stderr (tail) ---\n{result.stderr[-6000:]}")
    return result


def _logged(output_dir: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


# ---- the matrix --------------------------------------------------------------------------------

LAUNCHES = [None, "multi_gpu", "zero2", "zero3"]
# Every launch with a reference model (beta > 0), full and LoRA: TRL's prepared copy of the checkpoint, or the
# adapter-disabled base. Without one (beta 0: no reference model is built, whatever the launch), full and LoRA in
# one process. Each launch takes ~30 s of a 2-core machine, so the launch x beta x LoRA product is not run.
CASES = [(launch, 0.04, lora) for launch in LAUNCHES for lora in (False, True)]
CASES += [(None, 0.0, lora) for lora in (False, True)]
CASES.append(("zero3_offload", 0.04, False))  # the reference model under ZeRO-3 with parameters offloaded to CPU


def _case_id(case) -> str:
    launch, beta, lora = case
    return f"{launch or 'python'}-beta{beta:g}-{'lora' if lora else 'full'}"


def _param(case):
    """A case launched on two processes is marked ``launch`` (tests/launching.py)."""
    return pytest.param(*case, id=_case_id(case), marks=[pytest.mark.launch] if case[0] is not None else [])


@pytest.mark.parametrize("launch, beta, lora", [_param(case) for case in CASES])
def test_gsm8k_recipe_on_a_checkpoint(tmp_path, checkpoint, launch, beta, lora):
    directory, data = checkpoint
    output_dir = tmp_path / "out"
    args = ["--model_name_or_path", directory, "--dataset_name", data, "--output_dir", output_dir, "--beta", beta,
            *SMALL, *(LORA if lora else [])]
    result = _ok(_run(launch, "gsm8k", *args))

    # launched with the shipped config's mixed_precision: bf16 on a machine without CUDA: said, then fp32
    assert (FP32_WARNING in result.stderr) == (launch is not None), result.stderr[-3000:]
    world = 1 if launch is None else 2
    assert f"hf-grpo batch plan (world size {world})" in result.stderr
    assert f"(8 per device x {world} device{'s' if world > 1 else ''})" in result.stderr, result.stderr[-3000:]
    per_rank = json.loads((output_dir / "performance.json").read_text())["per_rank"]
    assert len(per_rank) == world and all(rank["peak_memory_gib"] > 0 for rank in per_rank), per_rank
    # DeepSpeed on CPU: its shared-memory all-reduce, which training never calls, is neither built nor loaded
    assert "deepspeed_shm_comm_op built" not in result.stdout + result.stderr

    rows = _logged(output_dir)
    assert [row["step"] for row in rows] == [1, 2]
    assert all(math.isfinite(row["loss"]) and math.isfinite(row["reward"]) for row in rows), rows
    # the checkpoint answers 7 or 3 about half the time each: some reward group must have had a spread
    assert max(row["reward_std"] for row in rows) > 0, "no learning signal: every group scored alike"
    if beta > 0:
        assert all("kl" in row and math.isfinite(row["kl"]) for row in rows), rows
        # step 1 samples from the policy as loaded: the reference model (TRL's copy of the checkpoint, or the
        # adapter-disabled base under LoRA) must give the same log-probs
        assert abs(rows[0]["kl"]) < 1e-4, rows[0]["kl"]
    else:
        assert all("kl" not in row for row in rows)  # no reference model at all

    initial = _weights(directory)
    saved = _weights(output_dir, "adapter_model.safetensors" if lora else "model.safetensors")
    assert {tensor.dtype for tensor in saved.values()} == {torch.float32}  # trained and saved in fp32, not bf16
    if lora:
        from peft import AutoPeftModelForCausalLM

        adapter_config = json.loads((output_dir / "adapter_config.json").read_text())
        assert adapter_config["base_model_name_or_path"] == directory  # where AutoPeftModel* finds the base
        model = AutoPeftModelForCausalLM.from_pretrained(output_dir)  # as a user reloads an adapter
        adapters = {name: p for name, p in model.named_parameters() if "lora_B" in name}
        assert adapters, [name for name, _ in model.named_parameters()]
        assert any(p.abs().max() > 0 for p in adapters.values()), "LoRA B still zero: the adapter never trained"
        state = model.merge_and_unload().state_dict()
    else:
        from transformers import AutoModelForCausalLM

        model, info = AutoModelForCausalLM.from_pretrained(output_dir, output_loading_info=True)
        assert not info["missing_keys"] and not info["mismatched_keys"], info
        state = model.state_dict()
    assert all(state[name].shape == tensor.shape for name, tensor in initial.items())
    changed = [name for name, tensor in initial.items() if not torch.equal(state[name], tensor.to(state[name].dtype))]
    assert changed, "the saved weights equal the initial checkpoint's"
    assert all(torch.isfinite(state[name]).all() for name in initial)


# ---- other ways in ------------------------------------------------------------------------------

def test_countdown_recipe_on_a_checkpoint(tmp_path, checkpoint):
    directory, _ = checkpoint
    output_dir = tmp_path / "out"
    result = _ok(_run(None, "countdown", "--model_name_or_path", directory, "--output_dir", output_dir,
                      "--num_train_samples", 32, *SMALL))
    assert FP32_WARNING not in result.stderr
    rows = _logged(output_dir)
    assert [row["step"] for row in rows] == [1, 2]
    assert all(math.isfinite(row["loss"]) for row in rows) and "rewards/countdown_reward/mean" in rows[0]
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, info = AutoModelForCausalLM.from_pretrained(output_dir, output_loading_info=True)
    assert not info["missing_keys"]
    assert AutoTokenizer.from_pretrained(output_dir).chat_template  # the tokenizer is saved next to the model


def test_load_in_4bit_on_cpu_fails_at_once_naming_the_fix(tmp_path, checkpoint):
    directory, data = checkpoint
    result = _run(None, "gsm8k", "--model_name_or_path", directory, "--dataset_name", data,
                  "--output_dir", tmp_path / "out", "--load_in_4bit", "true", "--use_peft", "true", *SMALL,
                  timeout=120)
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert "load_in_4bit" in last and "needs a CUDA GPU" in last and "drop --load_in_4bit" in last, last
    assert "batch plan" not in result.stderr  # refused before any training started
    assert not (tmp_path / "out" / "metrics.jsonl").exists()
