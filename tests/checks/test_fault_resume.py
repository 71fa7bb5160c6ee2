"""A rank killed mid-run under 2-process ZeRO-2 (CPU, gloo), with rows padded or packed, and every rank killed while a
checkpoint is being written: the run is resumed from its last complete checkpoint in the same launch shape and ends
where an uninterrupted padded run ends, the same logged metrics and the same weights."""

import json
import os
import signal
import subprocess
import time

import pytest
import torch
from tests.launching import accelerate_command, start_launch
from tests.side_by_side import stop
from tests.distributed.test_launch import ROOT, ZERO2_QUICKSTART, ZERO2_QUICKSTART_STEPS, _final_state, launch

from hf_grpo.recipe_support.reporting import current_run_rows, read_metrics

pytestmark = [pytest.mark.slow, pytest.mark.launch]
STEPS = ZERO2_QUICKSTART_STEPS
COMMON = ZERO2_QUICKSTART  # the uninterrupted run is conftest's zero2_quickstart_run, launched with these


def zero2_command(output_dir, *extra):
    return accelerate_command("--config_file", ROOT / "accelerate_configs" / "zero2.yaml", "--mixed_precision", "no",
                              ROOT / "recipes" / "quickstart.py", *COMMON, "--output_dir", output_dir, *extra,
                              processes=2)


def complete_checkpoints(output_dir):
    """Checkpoints whose save finished: trainer_state.json is written after the weights and optimizer state."""
    found = [p for p in output_dir.glob("checkpoint-*") if (p / "trainer_state.json").exists()]
    return sorted(found, key=lambda p: int(p.name.split("-")[1]))


def rank_process(launcher, rank):
    import psutil

    for child in psutil.Process(launcher.pid).children(recursive=True):
        try:
            if child.environ().get("RANK") == str(rank) and "quickstart.py" in " ".join(child.cmdline()):
                return child
        except psutil.Error:
            continue
    return None


def kill_rank_after_first_checkpoint(output_dir, *extra, rank=1, timeout=600):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DIFFU_", "WORLD_SIZE", "RANK", "LOCAL_RANK"))}
    launcher = start_launch(zero2_command(output_dir, *extra), processes=2, cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + timeout
        while not complete_checkpoints(output_dir):
            assert launcher.poll() is None, f"the run ended before its first checkpoint: {launcher.stderr.read()[-3000:]}"
            assert time.monotonic() < deadline, "no checkpoint in time"
            time.sleep(0.05)
        victim = rank_process(launcher, rank)
        assert victim is not None, "rank 1 not found among the launcher's processes"
        os.kill(victim.pid, signal.SIGKILL)
        launcher.wait(timeout=300)
    finally:
        stop(launcher)
    return launcher.returncode


def resume_after_a_killed_rank(output_dir, *extra):
    """Launch with ``extra`` flags, kill rank 1 after the first checkpoint, resume from the last complete one in
    the same launch shape; returns that checkpoint and the resumed launch's result."""
    assert kill_rank_after_first_checkpoint(output_dir, *extra) != 0  # the launcher reports the lost rank
    last = complete_checkpoints(output_dir)[-1]
    assert int(last.name.split("-")[1]) < STEPS, "the run finished before the kill: nothing was interrupted"
    result = launch("zero2", "recipes/quickstart.py", *COMMON, *extra, "--output_dir", output_dir,
                    "--resume_from_checkpoint", last)
    return last, result


def resumed_and_straight_rows(interrupted, straight_dir):
    """The metrics rows of the resumed run (its last run in ``interrupted``) and of the uninterrupted one, whose
    steps must be the whole run's."""
    straight = read_metrics(str(straight_dir / "metrics.jsonl"))
    resumed = current_run_rows(read_metrics(str(interrupted / "metrics.jsonl")))
    assert [r["step"] for r in resumed] == [r["step"] for r in straight] == list(range(1, STEPS + 1))
    return resumed, straight


def assert_same_metrics(resumed, straight):
    assert [r["reward"] for r in resumed] == [r["reward"] for r in straight]
    for ours, theirs in zip(resumed, straight):
        assert ours["loss"] == pytest.approx(theirs["loss"], rel=1e-5, abs=1e-7)


def test_a_killed_rank_resumes_from_the_last_checkpoint_to_the_uninterrupted_result(tmp_path, zero2_quickstart_run):
    straight_dir = zero2_quickstart_run

    interrupted = tmp_path / "interrupted"
    last, _ = resume_after_a_killed_rank(interrupted)
    assert_same_metrics(*resumed_and_straight_rows(interrupted, straight_dir))
    final, expected = _final_state(interrupted), _final_state(straight_dir)
    for name in expected:
        torch.testing.assert_close(final[name], expected[name], rtol=1e-6, atol=1e-7)
    assert json.loads((last / "trainer_state.json").read_text())["global_step"] == int(last.name.split("-")[1])


# Packed rows with a prompt's rows run once (forced on: a CPU run's "auto" keeps rows padded) only reorder sums
PACKED = ["--padding_free", "true"]


def test_a_killed_packed_run_resumes_to_the_uninterrupted_padded_result(tmp_path, zero2_quickstart_run):
    straight_dir = zero2_quickstart_run  # padded: the quickstart's own settings

    interrupted = tmp_path / "interrupted"
    _, result = resume_after_a_killed_rank(interrupted, *PACKED)
    assert "rows packed (padding_free=True)" in result.stderr  # the resumed run packed its micro-batches
    assert "micro-batches: a prompt's rows together" in result.stderr
    assert_same_metrics(*resumed_and_straight_rows(interrupted, straight_dir))
    # Adam divides each element's step by its own gradient's size: where that gradient is near zero, a packed sum's
    # rounding moves the element by up to 1e-4 of its value, so each tensor is compared as a whole. A key's bias has
    # no gradient at all in exact arithmetic (softmax ignores a shift shared by a query's scores): Adam walks it by
    # rounding noise in either run, and it is left out.
    final, expected = _final_state(interrupted), _final_state(straight_dir)
    compared = [name for name in expected if not name.endswith("k_proj.bias")]
    assert len(compared) == len(expected) - 2  # the tiny model has two layers
    for name in compared:
        assert ((final[name] - expected[name]).norm() / expected[name].norm()).item() < 1e-5, name


def kill_every_rank_during_a_save(output_dir, step, timeout=600):
    """Launch, and SIGKILL both ranks (then the launcher) as soon as ``checkpoint-<step>`` appears: mid-save.
    Returns the launcher's stderr."""
    import psutil

    env = {k: v for k, v in os.environ.items() if not k.startswith(("DIFFU_", "WORLD_SIZE", "RANK", "LOCAL_RANK"))}
    launcher = start_launch(zero2_command(output_dir), processes=2, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    target = output_dir / f"checkpoint-{step}"
    try:
        ranks = []
        deadline = time.monotonic() + timeout
        while not target.is_dir():
            assert launcher.poll() is None, f"the run ended before checkpoint-{step}: {launcher.stderr.read()[-3000:]}"
            assert time.monotonic() < deadline, f"no checkpoint-{step} in time"
            if len(ranks) < 2:
                ranks = [p for p in (rank_process(launcher, rank) for rank in (0, 1)) if p is not None]
            time.sleep(0.002)
        for process in ranks:  # the ranks run in sessions of their own: killed one by one, not by process group
            process.kill()
        psutil.wait_procs(ranks, timeout=30)
        os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait(timeout=60)
    finally:
        stop(launcher)
    return launcher.stderr.read()


def test_a_run_killed_during_a_save_resumes_with_true_from_the_last_complete_checkpoint(tmp_path,
                                                                                       zero2_quickstart_run):
    straight_dir = zero2_quickstart_run
    interrupted = tmp_path / "interrupted"
    kill_every_rank_during_a_save(interrupted, step=4)
    broken = interrupted / "checkpoint-4"
    assert broken.is_dir() and not (broken / "trainer_state.json").exists(), "the kill came after the save ended"
    assert [p.name for p in complete_checkpoints(interrupted)] == ["checkpoint-2"]

    result = launch("zero2", "recipes/quickstart.py", *COMMON, "--output_dir", interrupted,
                    "--resume_from_checkpoint", "true")
    assert f"resume_from_checkpoint=true skips {broken}:" in result.stderr
    assert f"resuming from {interrupted / 'checkpoint-2'}, the newest complete checkpoint" in result.stderr

    straight = read_metrics(str(straight_dir / "metrics.jsonl"))
    resumed = [r for r in read_metrics(str(interrupted / "metrics.jsonl")) if r["run"] == 2]
    assert [r["step"] for r in resumed] == list(range(3, STEPS + 1))
    assert_same_metrics(resumed, straight[2:])
    final, expected = _final_state(interrupted), _final_state(straight_dir)
    for name in expected:
        torch.testing.assert_close(final[name], expected[name], rtol=1e-6, atol=1e-7)
    # the resumed run saved step 4 again, whole; the interrupted save is kept aside
    assert [p.name for p in complete_checkpoints(interrupted)] == [f"checkpoint-{s}" for s in (2, 4, 6)]
    assert (interrupted / "_interrupted-checkpoint-4").is_dir()
