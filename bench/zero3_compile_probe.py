"""Which ways of compiling the decoder layers train as eager layers, launched as the exactness tests launch them.

``tests/scripts/packed_exactness_train.py``'s run (a tiny saved checkpoint, LoRA, a reference, ``num_iterations`` 2,
3 steps, fp32), one variant after another in one launch, each with a hook on every trained parameter that records
its gradient's norm at each backward. Compiled layers are refused under ZeRO-3's hooks on a GPU
(``ZERO3_CUDA_REASON``); this keeps the hooks with one process (which removes them in a run) and lifts the refusal to
see what goes wrong; ``PROBE_HOOKS=remove`` leaves one process's run as it is (no hooks), to see whether compiled
layers train as eager ones there. On a GPU (``EXACTNESS_ON_GPU=1``):

    accelerate launch --num_processes 1 --config_file accelerate_configs/zero3.yaml --mixed_precision no \\
        bench/zero3_compile_probe.py OUT CHECKPOINT eager_packed compiled compiled_aot compiled_padded ...

(or without ``--config_file`` and with one variant a launch: the plain run). Variants: ``eager_packed`` (rows
packed, no checkpointing; compare with it: a prompt's rows fall in the same micro-batches), ``eager_checkpointed``
(padded), ``compiled`` (inductor, the compiler's own recompute), ``compiled_aot`` (no code generation),
``compiled_outer`` (an eager checkpoint around the compiled forward), ``compiled_padded``, ``compiled_peft``
(PEFT's LoRA forward), ``compiled_fused`` (hf_grpo's fused LoRA forward, forced under ZeRO-3). One JSON line a
variant: its grad norms and losses, and against the first variant the relative difference of the weights' update
and the largest relative difference of a parameter's gradient in the first backward.
"""

from __future__ import annotations

import functools
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "scripts"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import packed_exactness_train as exactness  # noqa: E402
from one_launch import release_for_the_next_run  # noqa: E402
from provenance import with_provenance  # noqa: E402

from hf_grpo import close_distributed  # noqa: E402
from hf_grpo.distributed import zero3_one_process  # noqa: E402
from hf_grpo.training import compiled_layers, lora_forward  # noqa: E402

CONFIG, TRAINER = exactness.GRPOConfig, exactness.GRPOTrainer
LAYERS_INIT, RECOMPUTE_AVAILABLE = compiled_layers.CompiledTrainingLayers.__init__, \
    compiled_layers.compiler_checkpointing_available
HOOKS = os.environ.get("PROBE_HOOKS", "keep")  # "remove": the one-process run as it is, without DeepSpeed's hooks
# variant: (the script's own variant, config fields changed, compile backend, fused LoRA forced, compiler's recompute)
VARIANTS = {
    "eager_packed": ("packed", {}, None, False, True),
    "eager_checkpointed": ("checkpointed", {}, None, False, True),
    "compiled": ("compiled", {}, None, False, True),
    "compiled_aot": ("compiled", {}, "aot_eager_decomp_partition", False, True),
    "compiled_outer": ("compiled", {}, None, False, False),
    "compiled_padded": ("compiled", {"padding_free": False}, None, False, True),
    "compiled_peft": ("compiled", {"lora_fused_forward": False}, None, False, True),
    "compiled_fused": ("compiled", {}, None, True, True),
}


def run_variant(out: str, checkpoint: str, variant: str):
    """Train ``variant`` into ``out/variant``; returns the trainer and each trained parameter's gradient norms."""
    script_variant, fields, backend, fuse, recompute = VARIANTS[variant]
    grads: dict[str, list[float]] = {}

    class Recording(TRAINER):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            if fuse:
                self.decisions.lora_fused_layers = lora_forward.install(self.model.get_base_model())
            for name, param in self.model.named_parameters():
                if param.requires_grad:
                    grads[name] = []
                    param.register_hook(lambda g, name=name: grads[name].append(g.float().norm().item()) or None)

    compiled_layers.ZERO3_CUDA_REASON = None  # lifted: what the refusal guards against is measured here
    if HOOKS == "keep":
        zero3_one_process.removes_hooks = lambda *args, **kwargs: False  # the hooks kept, as with several processes
    compiled_layers.CompiledTrainingLayers.__init__ = (functools.partialmethod(LAYERS_INIT, backend=backend)
                                                       if backend else LAYERS_INIT)
    compiled_layers.compiler_checkpointing_available = RECOMPUTE_AVAILABLE if recompute else (lambda: False)
    exactness.GRPOConfig = lambda **kwargs: CONFIG(**{**kwargs, **fields})
    exactness.GRPOTrainer = Recording
    run_dir = os.path.join(out, variant)
    os.makedirs(run_dir, exist_ok=True)
    return exactness.main(run_dir, checkpoint, script_variant), grads


def summary(out: str, variant: str, grads: dict, reference: tuple[str, dict] | None) -> dict:
    logged = json.load(open(os.path.join(out, variant, "logged.json")))
    chosen = json.load(open(os.path.join(out, variant, "chosen_rank0.json")))
    row = dict(bench="zero3_compile_probe", variant=variant, compiled_graphs=chosen["compiled_graphs"],
               zero3_hooks=HOOKS,
               zero3_persistent=chosen.get("zero3_persistent"),  # [kept gathered, of all parameters]
               grad_norm=[r["grad_norm"] for r in logged], loss=[r["loss"] for r in logged])
    if reference is not None:
        name, want = reference
        flat = lambda state: torch.cat([state[n].flatten() for n in sorted(state)])  # noqa: E731
        update = lambda run: flat(run["trained"]) - flat(run["initial"])  # noqa: E731
        got, expected = (torch.load(os.path.join(out, v, "params.pt")) for v in (variant, name))
        row.update(against=name, update_rel_diff=((update(got) - update(expected)).norm()
                                                  / update(expected).norm()).item())
        differing = {n: abs(grads[n][0] - g[0]) / max(abs(g[0]), 1e-12) for n, g in want.items()}
        row["first_backward_worst"] = sorted(differing.items(), key=lambda item: -item[1])[:4]
    return row


def main() -> None:
    out, checkpoint, *variants = sys.argv[1:]
    unknown = [v for v in variants if v not in VARIANTS]
    if not variants or unknown:
        raise SystemExit(f"variants must be some of {sorted(VARIANTS)}, got {variants}")
    if HOOKS not in ("keep", "remove"):
        raise SystemExit(f"PROBE_HOOKS must be 'keep' or 'remove', got {HOOKS!r}")
    reference = None
    for index, variant in enumerate(variants):
        trainer, grads = run_variant(out, checkpoint, variant)
        if trainer.is_world_process_zero():
            print(json.dumps(with_provenance(summary(out, variant, grads, reference))), flush=True)
            reference = reference or (variant, grads)
        if index < len(variants) - 1:
            release_for_the_next_run(trainer)
    close_distributed(trainer)


if __name__ == "__main__":
    main()
