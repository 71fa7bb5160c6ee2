"""A launcher that dies takes its training processes with it (hf_grpo.distributed.launcher_watch), and a second run
into a folder a run is writing is refused on every process (hf_grpo.checks.output_lock).

Each test launches the quickstart as users do, waits until the run holds its output_dir, signals the launcher's pid
alone (as ``kill PID`` does; Ctrl-C in a terminal reaches the workers too), and checks that every process the
launcher started is gone within a few seconds and that no lock is left behind by a process that could release it.
"""

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
from tests.launching import accelerate_command, run_launch, start_launch
from tests.side_by_side import stop
from tests.distributed.test_launch import QUICK, ROOT

from hf_grpo.checks.output_lock import LOCK_FILE

pytestmark = [pytest.mark.slow, pytest.mark.launch]
GONE_WITHIN_S = 10  # the watch polls every 0.5 s; the rest is slack for a loaded machine
# long enough that the run is still training when it is killed; a checkpoint every step, as rotation would be seen
LONG_RUN = [*QUICK, "--max_steps", "100000", "--save_steps", "1", "--save_total_limit", "2", "--plot", "false"]


def launch_command(output_dir, processes, *extra):
    config = "single_gpu" if processes == 1 else "multi_gpu"
    return accelerate_command("--config_file", ROOT / "accelerate_configs" / f"{config}.yaml", "--mixed_precision",
                              "no", ROOT / "recipes" / "quickstart.py", *LONG_RUN, "--output_dir", output_dir, *extra,
                              processes=processes)


def clean_env():
    return {k: v for k, v in os.environ.items() if not k.startswith(("DIFFU_", "WORLD_SIZE", "RANK", "LOCAL_RANK"))}


def start_and_wait_for_the_lock(output_dir, processes, timeout=600):
    """The launcher, once the run holds output_dir (every worker has built its config, so is watching)."""
    log = output_dir.parent / "launch.log"  # a file, not a pipe: a full pipe would block the workers' logging
    with open(log, "w") as handle:
        # a session of its own: a signal reaches the launcher's pid only; SIGINT handled as a terminal's Ctrl-C is
        # (a background job of a script starts with SIGINT ignored, which the launcher would inherit)
        launcher = start_launch(launch_command(output_dir, processes), processes=processes, cwd=ROOT,
                                env=clean_env(), stdout=handle, stderr=subprocess.STDOUT,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    launcher.log = log
    deadline = time.monotonic() + timeout
    while not (output_dir / LOCK_FILE).exists():
        if launcher.poll() is not None or time.monotonic() > deadline:
            stop(launcher)
            pytest.fail(f"the run did not take its lock: {log.read_text()[-4000:]}")
        time.sleep(0.2)
    return launcher


def workers_of(launcher, processes):
    workers = [p for p in psutil.Process(launcher.pid).children(recursive=True)
               if "quickstart.py" in " ".join(p.cmdline())]
    assert len(workers) == processes, [p.cmdline() for p in workers]
    return psutil.Process(launcher.pid).children(recursive=True)  # the workers and anything they started


def kill_launcher_and_check_everything_ends(launcher, sig, processes, output_dir):
    started = workers_of(launcher, processes)
    try:
        os.kill(launcher.pid, sig)
        _, alive = psutil.wait_procs(started, timeout=GONE_WITHIN_S)
        assert not alive, f"still running {GONE_WITHIN_S} s after {sig.name} to the launcher: " + ", ".join(
            f"{p.pid} {' '.join(p.cmdline())[:120]}" for p in alive if p.is_running())
    finally:
        for process in started:  # nothing is left behind for the other tests, whatever failed
            try:
                process.kill()
            except psutil.Error:
                pass
        stop(launcher)
    return launcher.log.read_text()


def test_one_process_a_resume_meanwhile_is_refused_on_every_process_and_sigint_to_the_launcher_ends_the_run(
        tmp_path):
    out = tmp_path / "out"
    launcher = start_and_wait_for_the_lock(out, 1)
    try:
        worker = workers_of(launcher, 1)[0]
        lock = (out / LOCK_FILE).read_text()
        # a resume into the same folder, two processes: both refuse before training, naming the run that writes it
        second = run_launch(launch_command(out, 2, "--resume_from_checkpoint", "true"), processes=2, timeout=600,
                            cwd=ROOT, env=clean_env())
        assert second.returncode != 0
        refusal = f"is in use by another run (pid {worker.pid} on host"
        assert second.stderr.count(refusal) >= 2, second.stderr[-6000:]  # raised on both processes, none waits
        command = f"command: {os.path.basename(sys.executable)} {ROOT / 'recipes' / 'quickstart.py'} --use_cpu"
        assert command in second.stderr and "which is still running" in second.stderr
        assert launcher.poll() is None and (out / LOCK_FILE).read_text() == lock  # the first run goes on, still held
    except BaseException:
        stop(launcher)
        raise
    log = kill_launcher_and_check_everything_ends(launcher, signal.SIGINT, 1, out)
    # the worker sees its launcher gone (accelerate before 1.16), or the launcher stops it with SIGTERM (1.16 on)
    assert (f"the launcher (pid {launcher.pid}) of this training process (pid {worker.pid}) is gone: exiting" in log
            or f"hf_grpo: SIGTERM to this training process (pid {worker.pid}): releasing the output-dir lock" in log)
    assert not (out / LOCK_FILE).exists()  # released on the way out: the next run is not refused
    checkpoints = sorted(os.listdir(out))
    time.sleep(2)
    assert sorted(os.listdir(out)) == checkpoints  # nothing writes into the folder any more


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_one_process_the_worker_ends_with_its_launcher(tmp_path, sig):
    out = tmp_path / "out"
    launcher = start_and_wait_for_the_lock(out, 1)
    kill_launcher_and_check_everything_ends(launcher, sig, 1, out)
    assert not (out / LOCK_FILE).exists()


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["sigkill", "sigterm"])
def test_two_processes_both_workers_end_with_their_launcher(tmp_path, sig):
    out = tmp_path / "out"
    launcher = start_and_wait_for_the_lock(out, 2)
    kill_launcher_and_check_everything_ends(launcher, sig, 2, out)
    # SIGKILL: the launcher is gone at once, the workers see it and release the lock. SIGTERM: torchrun's agent
    # stops its workers with SIGTERM; a worker releases the lock on it once its main thread runs the handler, which a
    # collective in progress can delay past the agent's kill: then a later run takes the stale lock over.
    if sig == signal.SIGKILL:
        assert not (out / LOCK_FILE).exists()
