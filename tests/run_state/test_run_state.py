"""What the helpers see of a run (hf_grpo.run_state): facts, sizes and decisions, never the trainer; and the config
the user built is never written once the trainer is, while "auto" sizes and out-of-memory back-offs change the
run's sizes."""

import ast
import json
import pathlib

import hf_grpo
from hf_grpo import GRPOConfig
from hf_grpo.memory.saved_sizes import SIZES_FILE
from tests.memory.test_autosize import fake_cuda_probe
from tests.memory.test_oom import oom_after_sampling
from tests.test_trainer import make_trainer

PACKAGE = pathlib.Path(hf_grpo.__file__).parent
# The helper packages, and the callbacks the trainer adds: they take facts, sizes, decisions and plain values.
HELPERS = [*(PACKAGE / name for name in ("training", "memory", "generation")), PACKAGE / "run_callbacks.py"]


def helper_files():
    for place in HELPERS:
        yield from sorted(place.rglob("*.py")) if place.is_dir() else [place]


def test_no_helper_takes_or_keeps_the_trainer():
    found = []
    for path in helper_files():
        where = path.relative_to(PACKAGE.parent)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                arguments = node.args
                names = [a.arg for a in (*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs)]
                if "trainer" in names:
                    found.append(f"{where}:{node.lineno} {getattr(node, 'name', 'lambda')} takes a trainer")
            elif isinstance(node, ast.Attribute) and (
                    node.attr == "trainer" or isinstance(node.value, ast.Name) and node.value.id == "trainer"):
                found.append(f"{where}:{node.lineno} reads or keeps a trainer ({ast.unparse(node)})")
    assert len(list(helper_files())) > 30  # the scan saw the packages
    assert not found, "\n".join(found)


class WatchedConfig(GRPOConfig):
    """A GRPOConfig that records each attribute written once ``watch`` is called (on it or on a copy of it)."""

    def watch(self, writes: list):
        object.__setattr__(self, "_writes", writes)

    def __setattr__(self, name, value):
        writes = self.__dict__.get("_writes")
        if writes is not None:
            writes.append(name)
        super().__setattr__(name, value)


def test_auto_sizes_and_an_out_of_memory_change_the_run_sizes_never_the_config(tmp_path, monkeypatch):
    fake_cuda_probe(monkeypatch)  # "auto" sizes probed at train start, as on a GPU (every size fits)
    trainer = make_trainer(tmp_path, config_cls=WatchedConfig, fixed=False, per_device_train_batch_size="auto",
                           tensor_batch_size="auto", gradient_accumulation_steps=2, per_device_generation_batch_size=8,
                           save_strategy="steps", save_steps=1)
    config, writes = trainer.args, []
    config.watch(writes)
    assert config.auto_batch_fields == ("per_device_train_batch_size", "tensor_batch_size")
    calls = []
    trainer.model.generate = oom_after_sampling(trainer.model, 4, calls)  # more than 4 sequences: out of memory
    trainer.train()

    assert writes == [], f"the config was written after the trainer was built: {writes}"
    # the user's config as built: the provisional "auto" defaults, the generation chunk asked for
    assert (config.per_device_train_batch_size, config.gradient_accumulation_steps, config.tensor_batch_size,
            config.per_device_generation_batch_size) == (8, 2, 1024, 8)
    # the run's sizes: the probe's micro-batch of the whole step (16 rows, one accumulation step), its head chunk,
    # and the generation chunk halved after the out-of-memory
    sizes = trainer.sizes
    assert (sizes.per_device_train_batch_size, sizes.gradient_accumulation_steps, sizes.steps_per_generation,
            sizes.tensor_batch_size, sizes.per_device_generation_batch_size) == (16, 1, 1, 256, 4)
    assert calls[0] == 8 and set(calls[1:]) == {4} and sizes.auto_fields == ()
    # TRL and transformers trained with the chosen micro-batch: from a copy of the config, not the config
    assert trainer.args is not config and trainer.args.per_device_train_batch_size == 16
    assert trainer.state.log_history[0]["perf/per_device_generation_batch_size"] == 4
    plan = trainer.get_performance_stats()["batch_plan"]
    assert (plan["per_device_train_batch_size"], plan["per_device_generation_batch_size"]) == (16, 4)
    saved = json.loads((tmp_path / "out" / "checkpoint-1" / SIZES_FILE).read_text())
    assert (saved["per_device_train_batch_size"], saved["tensor_batch_size"],
            saved["per_device_generation_batch_size"]) == (16, 256, 4)
    assert saved["configured"]["per_device_generation_batch_size"] == 8  # where the halved chunk started


def test_only_the_trainer_modules_read_the_trainers_private_state():
    """TRL's private attributes change between releases: their reads stay where the overrides are pinned, and in
    the one module that names other libraries' private names (``runtime/upstream.py``, checked to exist)."""
    allowed = {PACKAGE / "trainer.py", PACKAGE / "diffusion" / "trainer.py", PACKAGE / "runtime" / "upstream.py"}
    found = []
    for path in sorted(set(PACKAGE.rglob("*.py")) - allowed):
        for node in ast.walk(ast.parse(path.read_text())):
            holder = node.value if isinstance(node, ast.Attribute) else None
            named_trainer = isinstance(holder, ast.Name) and holder.id == "trainer" or (
                isinstance(holder, ast.Attribute) and holder.attr == "trainer")
            if named_trainer and node.attr.startswith("_") and not node.attr.startswith("__"):
                found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {ast.unparse(node)}")
    assert not found, "\n".join(found)
