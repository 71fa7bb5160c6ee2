"""A library script's run (hf_grpo.GRPOTrainer, no recipe) writes metrics.jsonl and performance.json, once each."""

import json

from tests.test_trainer import TOKENIZER, count_a_reward, make_trainer, prompt_dataset

from hf_grpo import GRPOConfig, GRPOTrainer
from hf_grpo.recipe_support.tiny import build_tiny_model
from hf_grpo.run_files import MetricsFileCallback, PerformanceFileCallback, read_metrics


def test_a_library_run_writes_metrics_and_performance_files(tmp_path):
    trainer = make_trainer(tmp_path, max_steps=2)
    trainer.train()
    out = tmp_path / "out"
    rows = read_metrics(str(out / "metrics.jsonl"))
    logged = [row for row in trainer.state.log_history if "loss" in row]
    assert [row["step"] for row in rows] == [1, 2]  # one line per logging step, not two
    assert [row["loss"] for row in rows] == [row["loss"] for row in logged]
    assert [row["reward"] for row in rows] == [row["reward"] for row in logged]
    per_rank = json.loads((out / "performance.json").read_text())["per_rank"]
    assert len(per_rank) == 1 and per_rank[0]["step_s"] > 0 and per_rank[0]["peak_memory_gib"] > 0, per_rank
    assert per_rank[0]["batch_plan"] == json.loads(json.dumps(trainer.batch_plan().to_dict()))


def test_a_writer_passed_in_callbacks_is_used_instead_of_a_second_one(tmp_path):
    args = GRPOConfig(output_dir=str(tmp_path / "out"), report_to=[], use_cpu=True, bf16=False, max_steps=2,
                      per_device_train_batch_size=8, num_generations=4, max_completion_length=4, logging_steps=1,
                      save_strategy="no", disable_tqdm=True)
    mine = MetricsFileCallback(args.output_dir)
    trainer = GRPOTrainer(model=build_tiny_model(TOKENIZER), reward_funcs=count_a_reward, args=args,
                          train_dataset=prompt_dataset(), processing_class=TOKENIZER, callbacks=[mine])
    writers = [cb for cb in trainer.callback_handler.callbacks if isinstance(cb, MetricsFileCallback)]
    assert writers == [mine]
    trainer.train()
    assert [row["step"] for row in read_metrics(str(tmp_path / "out" / "metrics.jsonl"))] == [1, 2]


def test_removing_the_callbacks_writes_neither_file(tmp_path):
    trainer = make_trainer(tmp_path, max_steps=1)
    trainer.remove_callback(MetricsFileCallback)
    trainer.remove_callback(PerformanceFileCallback)
    trainer.train()
    assert not (tmp_path / "out" / "metrics.jsonl").exists()
    assert not (tmp_path / "out" / "performance.json").exists()


def test_a_writer_added_after_construction_does_not_write_the_rows_twice(tmp_path):
    """Scripts written before the trainer added its own writer call add_callback themselves: one line a step."""
    trainer = make_trainer(tmp_path, max_steps=2)
    trainer.add_callback(MetricsFileCallback(trainer.args.output_dir))
    trainer.train()
    rows = read_metrics(str(tmp_path / "out" / "metrics.jsonl"))
    assert [row["step"] for row in rows] == [1, 2]
    assert [row["run"] for row in rows] == [1, 1]
    trainer.train()  # a second train() into the folder is run 2, still written once
    assert [row["run"] for row in read_metrics(str(tmp_path / "out" / "metrics.jsonl"))] == [1, 1, 2, 2]
