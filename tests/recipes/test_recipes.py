"""Recipes with --tiny: each runs offline end to end on CPU."""

import json
import pathlib

import pytest
from tests.project_files import load_recipe

ROOT = pathlib.Path(__file__).resolve().parents[2]
QUICK = ["--tiny", "--max_steps", "2", "--per_device_train_batch_size", "8", "--max_completion_length", "12",
         "--logging_steps", "1", "--disable_tqdm", "true", "--report_to", "none"]


def run_recipe(name, *args):
    return load_recipe(name).main([*QUICK, *map(str, args)])


def logged(output_dir):
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_countdown_tiny_with_its_yaml(tmp_path):
    trainer = run_recipe("countdown", "--config", ROOT / "recipes" / "countdown.yaml", "--output_dir", tmp_path,
                         "--num_train_samples", 64, "--dtype", "float32")
    rows = logged(tmp_path)
    assert [r["step"] for r in rows] == [1, 2]
    assert "rewards/countdown_reward/mean" in rows[0]
    plan = trainer.batch_plan()  # the YAML's values, with the command line's per-device batch of 8
    assert (plan.gradient_accumulation_steps, plan.per_device_generation_batch_size) == (4, 16)
    assert plan.generation_chunks == 2


@pytest.mark.slow
def test_gsm8k_tiny_from_a_local_jsonl(tmp_path):
    data = tmp_path / "gsm8k.jsonl"
    data.write_text("\n".join(json.dumps({"question": f"What is {a} + {a}?", "answer": f"{a}+{a}={2 * a}\n#### {2 * a}"})
                              for a in range(8)))
    run_recipe("gsm8k", "--dataset_name", data, "--output_dir", tmp_path / "out", "--num_generations", 4)
    rows = logged(tmp_path / "out")
    assert [r["step"] for r in rows] == [1, 2]
    assert {"rewards/gsm8k_format_reward/mean", "rewards/gsm8k_correctness_reward/mean"} <= set(rows[0])


@pytest.mark.slow
def test_gsm8k_tiny_with_its_yaml_builds_a_reference_model(tmp_path):
    """gsm8k.yaml sets beta 0.04: TRL loads the reference from the policy's path, which --tiny must provide."""
    data = tmp_path / "gsm8k.jsonl"
    data.write_text("\n".join(json.dumps({"question": f"What is {a} * 3?", "answer": f"#### {3 * a}"})
                              for a in range(8)))
    trainer = run_recipe("gsm8k", "--config", ROOT / "recipes" / "gsm8k.yaml", "--dataset_name", data,
                         "--output_dir", tmp_path / "out", "--num_generations", 4, "--dtype", "float32")
    assert trainer.beta == 0.04 and trainer.ref_model is not None
    rows = logged(tmp_path / "out")
    assert [r["step"] for r in rows] == [1, 2] and all("kl" in r for r in rows)


def test_prompts_become_chat_turns_only_for_tokenizers_with_a_template():
    from datasets import Dataset

    from hf_grpo.recipe_support.launch import chat_prompts_if_templated
    from hf_grpo.recipe_support.tiny import build_char_tokenizer

    dataset = Dataset.from_dict({"prompt": ["what is 1+1?"], "answer": ["#### 2"]})
    tokenizer = build_char_tokenizer()
    assert chat_prompts_if_templated(dataset, tokenizer)["prompt"] == ["what is 1+1?"]
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    chat = chat_prompts_if_templated(dataset, tokenizer)
    assert chat["prompt"] == [[{"role": "user", "content": "what is 1+1?"}]]
    assert chat["answer"] == ["#### 2"]
