"""An output_dir holding another run is never overwritten by surprise (hf_grpo.checks.output_dirs), and
metrics.jsonl is only appended to, one run after another (hf_grpo.run_files)."""

import json

import pytest
from tests.test_trainer import make_trainer

from hf_grpo.checks.output_dirs import previous_checkpoints
from hf_grpo.run_files import current_run_rows, read_metrics


def run(tmp_path, resume=None, **overrides):
    values = dict(max_steps=2, save_strategy="steps", save_steps=2, save_total_limit=1, fixed=True)
    values.update(overrides)
    trainer = make_trainer(tmp_path, **values)  # writes metrics.jsonl itself (hf_grpo.run_files)
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def metrics(tmp_path):
    return read_metrics(str(tmp_path / "out" / "metrics.jsonl"))


def test_a_fresh_run_into_another_runs_checkpoints_is_refused_and_deletes_nothing(tmp_path):
    run(tmp_path)
    out = tmp_path / "out"
    assert previous_checkpoints(str(out)) == ["checkpoint-2"]
    before = (out / "metrics.jsonl").read_text()
    with pytest.raises(ValueError) as err:
        run(tmp_path, max_steps=1, save_steps=1)  # would save checkpoint-1 and rotate checkpoint-2 away
    message = str(err.value)
    assert "holds checkpoints of another run (checkpoint-2)" in message
    assert f"--resume_from_checkpoint {out / 'checkpoint-2'}" in message and "--overwrite_output_dir true" in message
    assert previous_checkpoints(str(out)) == ["checkpoint-2"]
    assert (out / "metrics.jsonl").read_text() == before


def test_overwrite_output_dir_starts_over_and_keeps_the_old_metrics_lines(tmp_path):
    run(tmp_path)
    run(tmp_path, max_steps=1, save_steps=1, overwrite_output_dir=True)
    assert previous_checkpoints(str(tmp_path / "out")) == ["checkpoint-1"]
    rows = metrics(tmp_path)
    assert [(r["run"], r["step"]) for r in rows] == [(1, 1), (1, 2), (2, 1)]  # appended, never truncated
    assert [(r["run"], r["step"]) for r in current_run_rows(rows)] == [(2, 1)]  # the plot shows the new run


def test_a_resumed_run_appends_and_its_history_replaces_only_the_redone_steps(tmp_path):
    run(tmp_path, max_steps=3, save_steps=1, save_total_limit=None)
    run(tmp_path, max_steps=3, save_steps=1, save_total_limit=None,
        resume=str(tmp_path / "out" / "checkpoint-1"))
    rows = metrics(tmp_path)
    assert [(r["run"], r["step"]) for r in rows] == [(1, 1), (1, 2), (1, 3), (2, 2), (2, 3)]
    assert [(r["run"], r["step"]) for r in current_run_rows(rows)] == [(1, 1), (2, 2), (2, 3)]
    assert {r["run_start_step"] for r in rows if r["run"] == 2} == {1}


def test_rows_of_an_older_metrics_file_without_run_numbers_are_kept(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "metrics.jsonl").write_text(json.dumps({"step": 5, "loss": 0.1}) + "\n")
    run(tmp_path, max_steps=1, save_strategy="no")
    rows = metrics(tmp_path)
    assert rows[0] == {"step": 5, "loss": 0.1} and rows[1]["run"] == 1
    assert [r["step"] for r in current_run_rows(rows)] == [1]


def test_a_recipe_resumes_from_the_latest_checkpoint_with_resume_from_checkpoint_true(tmp_path):
    from tests.project_files import load_recipe

    quickstart = load_recipe("quickstart")
    args = ["--output_dir", str(tmp_path), "--per_device_train_batch_size", "8", "--save_steps", "1", "--logging_steps",
            "1", "--disable_tqdm", "true", "--plot", "false"]
    quickstart.main([*args, "--max_steps", "1"])
    trainer = quickstart.main([*args, "--max_steps", "2", "--resume_from_checkpoint", "true"])
    assert trainer.state.global_step == 2
    rows = read_metrics(str(tmp_path / "metrics.jsonl"))
    assert [(r["run"], r["step"], r["run_start_step"]) for r in rows] == [(1, 1, 0), (2, 2, 1)]
