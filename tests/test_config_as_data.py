"""A config is data: building a ``GRPOConfig`` (or a ``DiffuGRPOConfig``) starts no thread, leaves ``os.environ`` and
CUDA as they were and asks the machine only for the defaults the user left out; the process's setup (the launcher
watch, a launcher's bf16 turned off on a CPU) is ``hf_grpo.prepare_process``'s, the trainer's first step."""

import collections
import os
import threading

import pytest
import torch
import trl

from hf_grpo import GRPOConfig, prepare_process
from hf_grpo.diffusion import DiffuGRPOConfig
from hf_grpo.distributed import launcher_watch

WATCH = "hf_grpo-launcher-watch"
PROBES = ("is_available", "device_count", "is_bf16_supported", "current_device", "set_device", "init")


def thread_names() -> list[str]:
    return sorted(thread.name for thread in threading.enumerate())


@pytest.fixture
def under_a_launcher(monkeypatch):
    """This process as ``accelerate launch --config_file accelerate_configs/zero2.yaml`` starts it: a launcher's
    variable, a launcher as the parent, the config's bf16 passed on. The watch's thread runs until the test ends,
    without the exit it would make when the (real) parent goes."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run")
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    monkeypatch.delenv(launcher_watch.OPT_OUT, raising=False)
    monkeypatch.setattr(launcher_watch, "_parent_command", lambda pid: "/venv/bin/accelerate launch train.py")
    monkeypatch.setattr(launcher_watch, "_watching", None)
    done = threading.Event()
    monkeypatch.setattr(launcher_watch, "_watch", lambda parent: done.wait())
    yield
    done.set()


@pytest.fixture
def probes(monkeypatch):
    """The names of the ``torch.cuda`` functions called, in order (each still does its work)."""
    calls = []
    for name in PROBES:
        original = getattr(torch.cuda, name)
        monkeypatch.setattr(torch.cuda, name, lambda *a, _f=original, _n=name, **k: calls.append(_n) or _f(*a, **k))
    return calls


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the launcher's bf16 stays, and transformers' own "
                    "TrainingArguments sets up the CUDA device while the config is built")
@pytest.mark.parametrize("config_class", [GRPOConfig, DiffuGRPOConfig])
def test_building_a_config_leaves_threads_environment_and_cuda_as_they_were(tmp_path, under_a_launcher,
                                                                            config_class):
    threads, environment, cuda = thread_names(), dict(os.environ), torch.cuda.is_initialized()
    config = config_class(output_dir=str(tmp_path / "out"), report_to=[])
    assert thread_names() == threads
    assert dict(os.environ) == environment
    assert torch.cuda.is_initialized() == cuda
    # yet the run is the one it was: fp32 on this CPU, and transformers built its precision from that, not the bf16
    assert not config.bf16 and config.mixed_precision == "no"

    prepare_process(config)  # what GRPOTrainer does first
    assert thread_names().count(WATCH) == 1 and os.environ["ACCELERATE_MIXED_PRECISION"] == "no"
    prepare_process(config)  # idempotent: a recipe calls it before its config, the trainer again
    assert thread_names().count(WATCH) == 1


def test_given_use_cpu_and_bf16_the_config_asks_the_machine_nothing_of_its_own(tmp_path, probes):
    machine = dict(use_cpu=not torch.cuda.is_available(), bf16=torch.cuda.is_available() and
                   torch.cuda.is_bf16_supported())
    probes.clear()
    trl.GRPOConfig(output_dir=str(tmp_path / "trl"), report_to=[], **machine)
    upstream, probes[:] = list(probes), []
    GRPOConfig(output_dir=str(tmp_path / "hf"), report_to=[], **machine)
    assert probes == upstream  # transformers' own device set-up, nothing more


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU bf16 support is probed too")
@pytest.mark.parametrize("config_class", [GRPOConfig, DiffuGRPOConfig])
def test_left_out_the_machine_is_asked_once_whether_it_has_cuda(tmp_path, monkeypatch, probes, config_class):
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")  # the launcher's bf16 needs the same answer
    config = config_class(output_dir=str(tmp_path / "out"), report_to=[])
    assert config.use_cpu and not config.bf16
    assert collections.Counter(probes) == {"is_available": 1}  # no context made: CUDA stays uninitialised
