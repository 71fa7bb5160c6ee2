"""Train GRPO 2 steps under ZeRO-3 with ``zero3_leaf_modules`` set as given; write what was logged and how
DeepSpeed hooked the decoder layers.

    accelerate launch --num_processes 2 --config_file accelerate_configs/zero3.yaml --mixed_precision no \
        tests/scripts/zero3_leaves_train.py OUT_DIR CHECKPOINT_DIR SETTING:VARIANT [SETTING:VARIANT ...]

Each SETTING:VARIANT (e.g. ``auto:full``, ``off:lora-no-gc``) trains in turn in the same two processes (one launch
pays the start-up once), writing into OUT_DIR/SETTING-VARIANT; accelerate's state is reset between them, so each
trainer builds its own DeepSpeed config from its own arguments.

``full`` (the default) fine-tunes everything with a reference model (beta > 0, built by TRL from CHECKPOINT_DIR);
``lora`` has none; ``lora-no-gc`` is ``lora`` without gradient checkpointing (the decoder layers' inputs then need
no gradient: the frozen embeddings feed them). The others keep the default, gradient checkpointing on.
Rank 0 writes OUT_DIR/SETTING-VARIANT/result.json: the logged rows of each step, and for the policy (and the reference) per
decoder layer whether it carries DeepSpeed's leaf flag, whether DeepSpeed tied its parameters to it as a leaf
(``ds_z3_leaf_module``, set only when the flag was there as its hooks were registered) and whether its children
got hooks of their own (``ds_id``, given to every module DeepSpeed registers); trained.pt next to it holds the
trainable weights after the last step.
"""

import json
import os
import sys

import deepspeed
import torch
from datasets import Dataset
from one_launch import release_for_the_next_run

from hf_grpo import GRPOConfig, GRPOTrainer, close_distributed


def reward(completions, **kwargs):
    return [len(set(text)) / 8 for text in completions]  # varies within a group: advantages are not all zero


def hooks(model: torch.nn.Module) -> dict:
    """How DeepSpeed treated each decoder layer of ``model`` (an engine's module, PEFT-wrapped or not)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    layers = list(base.model.layers)
    return {
        "layers": len(layers),
        "flagged": sum(bool(getattr(layer, "_z3_leaf", False)) for layer in layers),
        "params_tied_to_leaf": sum(all(getattr(p, "ds_z3_leaf_module", None) is layer for p in layer.parameters())
                                   for layer in layers),
        "children_hooked": sum(any(hasattr(child, "ds_id") for child in layer.modules() if child is not layer)
                               for layer in layers),
        "layers_hooked": sum(hasattr(layer, "ds_id") for layer in layers),
    }


def train(out_dir: str, checkpoint: str, setting: str, variant: str) -> GRPOTrainer:
    lora = variant.startswith("lora")
    args = GRPOConfig(
        output_dir=out_dir, report_to=[], use_cpu=True, bf16=False, max_steps=2, seed=3,
        per_device_train_batch_size=4, num_generations=4, max_completion_length=8, temperature=1.0,
        learning_rate=0.05, optim="sgd", lr_scheduler_type="constant", save_strategy="no", logging_steps=1,
        disable_tqdm=True, generation_backend="hf", beta=0.0 if lora else 0.04, zero3_leaf_modules=setting,
        **({"activation_checkpointing": False} if variant == "lora-no-gc" else {}),  # else the default (on)
    )
    peft_config = None
    if lora:
        from peft import LoraConfig

        peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
    prompts = ["ab>", "c>", "defg>", "h>", "ij>", "klmno>", "p>", "qr>"]
    trainer = GRPOTrainer(model=checkpoint, reward_funcs=reward, args=args, peft_config=peft_config,
                          train_dataset=Dataset.from_dict({"prompt": prompts * 4}))
    trainer.train()

    result = {
        "marking": {"classes": list(trainer.zero3_leaf_marking.classes), "count": trainer.zero3_leaf_marking.count},
        "plan": str(trainer.batch_plan()),
        "policy": hooks(trainer.accelerator.unwrap_model(trainer.model_wrapped)),
        "reference": None if trainer.ref_model is None else hooks(trainer.accelerator.unwrap_model(trainer.ref_model)),
        "logged": [{k: v for k, v in row.items() if isinstance(v, (int, float))}
                   for row in trainer.state.log_history if "loss" in row],
    }
    live = trainer.accelerator.unwrap_model(trainer.model_wrapped)
    with deepspeed.zero.GatheredParameters(list(live.parameters())):  # a collective: every rank
        weights = {name: p.detach().clone() for name, p in live.named_parameters() if p.requires_grad}
    if trainer.is_world_process_zero():
        torch.save(weights, f"{out_dir}/trained.pt")  # the trainable weights after the last optimizer step
        with open(f"{out_dir}/result.json", "w") as handle:
            json.dump(result, handle)
    return trainer


def main(out_dir: str, checkpoint: str, scenarios: list[str]) -> None:
    for index, scenario in enumerate(scenarios):
        setting, variant = scenario.split(":")
        run_dir = os.path.join(out_dir, f"{setting}-{variant}")
        os.makedirs(run_dir, exist_ok=True)
        trainer = train(run_dir, checkpoint, setting, variant)
        if index < len(scenarios) - 1:
            release_for_the_next_run(trainer)
    close_distributed(trainer)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
