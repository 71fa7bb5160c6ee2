"""Other libraries' private names are read in one module, ``hf_grpo/runtime/upstream.py``, and every one of them
exists in the versions installed.

The first half scans the package with ``ast``: outside that module no file reads, writes or calls a private name
of TRL, transformers, accelerate or DeepSpeed (``x._name``, ``getattr(x, "_name")``, DeepSpeed's unprefixed
internals), the trainers' listed overrides of TRL's private methods excepted. The second half builds a real tiny
trainer and a one-process DeepSpeed engine on the CPU and looks each name of ``upstream.NAMES`` up on them: a
library upgrade that renames one fails here, naming it.
"""

from __future__ import annotations

import ast
import inspect
import json
import os
import pathlib
import re
import subprocess
import sys
import textwrap

import pytest

from hf_grpo.runtime import upstream
from tests.side_by_side import free_port

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "hf_grpo"
UPSTREAM_MODULE = PACKAGE / "runtime" / "upstream.py"

# torch's and the standard library's private names the package uses: outside the rule (torch comes with its wheels,
# not through a range the trainers subclass; ``os._exit`` is documented). Checked to be torch's below.
TORCH_OR_STDLIB = {
    "_exit",  # os._exit
    "_C", "_SetExcludeDispatchKeyGuard", "_dynamo", "_functorch", "_inductor", "_foreach_add_",  # torch.*
    "_DropoutNd",  # torch.nn.modules.dropout
    "_parameters", "_buffers", "_forward_hooks", "_forward_pre_hooks",  # torch.nn.Module
    "_pre_forward", "_post_forward", "_use_python_reducer", "_delay_all_reduce_params",  # DistributedDataParallel
    "_handle_pdl_before_access",  # torch._inductor.codegen.triton.TritonKernel (generation/launch_overlap.py)
}
# hf_grpo's own methods whose names an upstream class also uses (each only in its file, on hf_grpo's own object):
# StaticDecoder._prefill (transformers' GenerationMixin has one too).
OWN_BY_FILE = {("_prefill", "hf_grpo/generation/static_decoder.py")}


def upstream_class_names() -> set[str]:
    """The private names TRL's and transformers' trainer, transformers' models and configs and accelerate's state
    define: class members, and ``self._x =`` in their source (instance attributes)."""
    import accelerate
    import accelerate.state
    import transformers
    import trl

    libraries = ("trl", "transformers", "accelerate", "deepspeed", "peft")
    names: set[str] = set()
    for cls in (trl.GRPOTrainer, trl.GRPOConfig, transformers.PreTrainedModel, transformers.PretrainedConfig,
                accelerate.Accelerator, accelerate.state.GradientState, accelerate.state.AcceleratorState):
        for klass in inspect.getmro(cls):
            if klass.__module__.split(".")[0] not in libraries:
                continue
            names |= {n for n in vars(klass) if n.startswith("_") and not n.endswith("__")}
            names |= set(re.findall(r"self\.(_[A-Za-z]\w*)\s*(?::[^=\n]*)?=[^=]", inspect.getsource(klass)))
    return names


def own_names(trees: dict[str, ast.AST]) -> set[str]:
    """Names hf_grpo defines: functions, classes, modules, module-level names, and attributes assigned on
    ``self`` or, in a ``__new__``, on the object it makes."""
    names = {pathlib.Path(path).stem for path in trees}

    def assigned(scope: ast.AST, on_any_object: bool) -> None:
        for node in ast.walk(scope):
            if isinstance(node, (ast.Assign, ast.AnnAssign)):
                for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    for part in ast.walk(target):
                        if isinstance(part, ast.Name):
                            names.add(part.id)
                        elif isinstance(part, ast.Attribute) and isinstance(part.value, ast.Name) \
                                and (on_any_object or part.value.id == "self"):
                            names.add(part.attr)

    for tree in trees.values():
        assigned(tree, on_any_object=False)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
                if node.name == "__new__":
                    assigned(node, on_any_object=True)
            elif isinstance(node, ast.alias):
                names.add(node.asname or node.name.split(".")[-1])
    return names


def named(node: ast.AST) -> list[str]:
    """The attribute names ``node`` reads or writes: ``x.name``, ``getattr``/``hasattr``/``setattr``/``delattr``
    with a constant name, ``from m import name``."""
    if isinstance(node, ast.Attribute):
        return [node.attr]
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and len(node.args) > 1 \
            and node.func.id in ("getattr", "hasattr", "setattr", "delattr") \
            and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str):
        return [node.args[1].value]
    if isinstance(node, ast.ImportFrom):
        return [alias.name for alias in node.names]
    return []


def private_accesses(trees: dict[str, ast.AST], upstream_names: set[str]) -> list[str]:
    """``"file:line: name"`` for each access to another library's private name in ``trees`` (path -> module)."""
    listed = {n.name for n in upstream.NAMES}
    own = own_names(trees) - listed - upstream_names
    found = []
    for path, tree in trees.items():
        for node in ast.walk(tree):
            for name in named(node):
                private = name.startswith("_") and not (name.startswith("__") and name.endswith("__"))
                if not (private or name in upstream.UNPREFIXED):
                    continue
                if name in own or name in TORCH_OR_STDLIB or name in upstream.OVERRIDDEN or (name, path) in OWN_BY_FILE:
                    continue
                found.append((path, node.lineno, name))
    return [f"{path}:{line}: {name}" for path, line, name in sorted(found)]


def package_trees() -> dict[str, ast.AST]:
    return {str(p.relative_to(ROOT)): ast.parse(p.read_text(), str(p)) for p in sorted(PACKAGE.rglob("*.py"))
            if p != UPSTREAM_MODULE}


@pytest.fixture(scope="module")
def class_names():
    return upstream_class_names()


def test_no_module_but_upstream_touches_another_librarys_private_names(class_names):
    found = private_accesses(package_trees(), class_names)
    assert not found, ("private names of TRL, transformers, accelerate or DeepSpeed used outside "
                       "hf_grpo/runtime/upstream.py (add a function there, with the version it was read from):\n"
                       + "\n".join(found))


def test_the_scan_sees_reads_writes_getattr_imports_and_names_the_libraries_share(class_names):
    """The scan above holds only if it would see each way of touching such a name; hf_grpo's own names pass."""
    source = textwrap.dedent("""
        from deepspeed.runtime.utils import register_output_backward_hooks
        class Mine:
            def __init__(self):
                self._cache = {}
            def go(self, trainer, model, zero):
                trainer._metrics["train"]            # a read
                trainer._buffered_inputs = []        # a write, though self._buffered_inputs would look like ours
                self._buffered_inputs = None
                getattr(model.config, "_hf_hook", None)
                zero.bit16_groups
                super()._prepare_inputs(None)        # a listed override
                return self._cache, model._parameters
        """)
    found = private_accesses({"hf_grpo/x.py": ast.parse(source)}, class_names)
    assert [line.split(": ")[1] for line in found] == ["register_output_backward_hooks", "_metrics",
                                                        "_buffered_inputs", "_buffered_inputs", "_hf_hook",
                                                        "bit16_groups"], found


def test_the_torch_names_left_out_are_torchs_or_the_standard_librarys():
    import torch
    from torch.nn.modules import dropout
    from torch.nn.parallel import DistributedDataParallel

    import torch._dynamo, torch._functorch, torch._inductor  # noqa: E401, F401 (submodules, loaded on use)
    from torch._inductor.codegen.triton import TritonKernel

    homes = [os, torch, torch._C, dropout, torch.nn.Linear(1, 1), DistributedDataParallel, TritonKernel]

    missing = [name for name in TORCH_OR_STDLIB - {"_use_python_reducer", "_delay_all_reduce_params"}
               if not any(hasattr(home, name) for home in homes)]
    source = inspect.getsource(DistributedDataParallel)
    missing += [name for name in ("_use_python_reducer", "_delay_all_reduce_params") if f"self.{name}" not in source]
    assert not missing, missing


# ---- every name exists ------------------------------------------------------------------------------------------
DEEPSPEED_CHECK = """
import json, os, sys
os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
import torch, deepspeed
from hf_grpo.runtime import upstream
upstream.compatible_ops()["deepspeed_shm_comm"] = False  # the CPU comm op a training run never calls: not built
deepspeed.init_distributed(dist_backend="gloo")
owners = {}
for stage in (2, 3):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": stage},
              "zero_allow_untested_optimizer": True}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                      config=config)
    param = next(engine.module.parameters())
    if stage == 2:
        owners.update({"engine": engine, "ZeRO optimizer": engine.optimizer, "ZeRO-1/2 optimizer": engine.optimizer,
                       "ZeRO-1/2 parameter": param})
    else:
        owners.update({"ZeRO-3 parameter": param, "ZeRO-3 parameter offload": upstream.zero3_gathering(engine)})
import deepspeed.ops, deepspeed.runtime.utils, deepspeed.runtime.base_optimizer
owners.update({"deepspeed.ops": deepspeed.ops, "deepspeed.runtime.utils": deepspeed.runtime.utils,
               "deepspeed.runtime.base_optimizer": deepspeed.runtime.base_optimizer})
print(json.dumps([n.name for n in upstream.NAMES if n.version == upstream.DEEPSPEED
                  and not hasattr(owners[n.owner], n.name)]))
"""


def missing_on(owners: dict, version: str) -> list[str]:
    return [f"{n.owner}.{n.name} ({n.version})" for n in upstream.NAMES
            if n.version == version and not hasattr(owners[n.owner], n.name)]


def test_every_name_of_trl_transformers_and_accelerate_exists_on_a_real_trainer(tmp_path):
    import transformers
    import trl
    from tests.test_trainer import make_trainer

    trainer = make_trainer(tmp_path)
    model = trainer.model
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    owners = {"trainer": trainer, "trl.GRPOTrainer": trl.GRPOTrainer, "config": model.config, "model": model,
              "checkpointed decoder layer": model.model.layers[0],
              "transformers.AutoModelForCausalLM": transformers.AutoModelForCausalLM,
              "accelerator.gradient_state": trainer.accelerator.gradient_state}
    missing = [m for version in (upstream.TRL, upstream.TRANSFORMERS, upstream.ACCELERATE)
               for m in missing_on(owners, version)]
    assert not missing, (f"gone in trl {trl.__version__} / transformers {transformers.__version__}: {missing}; "
                         f"adapt hf_grpo/runtime/upstream.py")
    # and the functions read them as they were read before: the trainer's tokenizer, TRL's metrics, a model's config
    assert upstream.tokenizer(trainer) is trainer.processing_class
    assert upstream.metrics(trainer, "train") is trainer._metrics["train"]
    assert upstream.attention_implementation(model.config) == "sdpa" and upstream.name_or_path(model.config) == ""
    assert not upstream.replaces_trl_loss(type(trainer))


def test_every_name_of_deepspeed_exists_on_a_one_process_engine():
    pytest.importorskip("deepspeed")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-c", DEEPSPEED_CHECK, str(free_port())], capture_output=True, text=True, env=env,
                         timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    import deepspeed

    missing = json.loads(run.stdout.strip().splitlines()[-1])
    assert missing == [], f"gone in deepspeed {deepspeed.__version__}: {missing}; adapt hf_grpo/runtime/upstream.py"


def test_every_name_of_peft_exists_on_a_lora_model():
    import peft
    from peft import LoraConfig, get_peft_model

    from hf_grpo.recipe_support.tiny import build_char_tokenizer, build_tiny_model

    model = get_peft_model(build_tiny_model(build_char_tokenizer()), LoraConfig(r=2, target_modules=["q_proj"]))
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    missing = missing_on({"PEFT adapter layer": layer, "PEFT model": model}, upstream.PEFT)
    assert not missing, f"gone in peft {peft.__version__}: {missing}; adapt hf_grpo/runtime/upstream.py"
    # read and set as PEFT's own switch reads and sets them
    with model.disable_adapter():
        assert upstream.adapters_disabled(layer) and upstream.model_adapters_disabled(model)
    assert not upstream.adapters_disabled(layer) and upstream.model_adapters_disabled(model) is False
