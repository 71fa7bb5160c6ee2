"""A metrics.jsonl whose last write was cut short (a kill mid-write, a full disk) blocks no later run: the torn line
is set aside to metrics.jsonl.torn, kept, with a warning naming the file; a bad line anywhere else is an error naming
the file and the line (hf_grpo.run_files)."""

import json
import logging
import re

import pytest
from tests.test_trainer import make_trainer

from hf_grpo.run_files import read_metrics

TORN = b'{"step": 9, "loss": -0.016, "lea'


def train(tmp_path, resume=None, **overrides):
    values = dict(max_steps=2, save_strategy="steps", save_steps=2, save_total_limit=1)
    values.update(overrides)
    trainer = make_trainer(tmp_path, **values)
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def cut_last_write(metrics):
    """What a kill in the middle of the next row's write leaves."""
    with open(metrics, "ab") as handle:
        handle.write(TORN)


@pytest.mark.parametrize("how", ["resume", "overwrite"])
def test_a_run_into_a_folder_whose_metrics_end_torn_sets_the_line_aside_and_goes_on(tmp_path, caplog, how):
    train(tmp_path)
    metrics = tmp_path / "out" / "metrics.jsonl"
    cut_last_write(metrics)
    with caplog.at_level(logging.WARNING, logger="hf_grpo"):
        if how == "resume":
            train(tmp_path, resume=True, max_steps=3, save_steps=3)
        else:
            train(tmp_path, overwrite_output_dir=True)
    assert f"{metrics}: its last line was cut short" in caplog.text and f"moved to {metrics}.torn" in caplog.text
    assert (tmp_path / "out" / "metrics.jsonl.torn").read_bytes() == TORN + b"\n"  # kept, not deleted
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]  # every line a whole row again
    expected = [(1, 1), (1, 2), (2, 3)] if how == "resume" else [(1, 1), (1, 2), (2, 1), (2, 2)]
    assert [(row["run"], row["step"]) for row in rows] == expected


def test_reading_leaves_a_torn_last_line_out_with_a_warning_and_changes_nothing(tmp_path, caplog):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_bytes(b'{"step": 1, "loss": 0.5}\n\n{"step": 2, "loss": 0.25}\n' + TORN)
    with caplog.at_level(logging.WARNING, logger="hf_grpo"):
        assert [row["step"] for row in read_metrics(str(metrics))] == [1, 2]
    assert f"{metrics}: its last line is cut short" in caplog.text
    assert metrics.read_bytes().endswith(TORN) and not (tmp_path / "metrics.jsonl.torn").exists()


def test_a_bad_line_before_the_last_is_an_error_naming_the_file_and_line(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_bytes(b'{"step": 1, "loss": 0.5}\n' + TORN + b'\n{"step": 2, "loss": 0.25}\n')
    where = re.escape(str(metrics))
    with pytest.raises(ValueError, match=where + r", line 2 of 3: not a JSON row .*Delete or repair line 2"):
        read_metrics(str(metrics))


@pytest.mark.parametrize("line", [b"[1, 2]", b"7", b'"step"'])
def test_a_line_that_is_json_but_no_row_is_an_error_naming_the_file_and_line(tmp_path, line):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_bytes(b'{"step": 1, "loss": 0.5}\n' + line + b"\n")
    with pytest.raises(ValueError, match=re.escape(str(metrics)) + r", line 2: a JSON \w+ where a row"):
        read_metrics(str(metrics))


def test_a_last_row_whose_newline_was_cut_off_is_kept_and_the_next_row_starts_a_line(tmp_path):
    train(tmp_path)
    metrics = tmp_path / "out" / "metrics.jsonl"
    metrics.write_bytes(metrics.read_bytes().rstrip(b"\n"))
    train(tmp_path, resume=True, max_steps=3, save_steps=3)
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [(row["run"], row["step"]) for row in rows] == [(1, 1), (1, 2), (2, 3)]
    assert not (tmp_path / "out" / "metrics.jsonl.torn").exists()
