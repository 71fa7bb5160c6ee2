"""Train a saved tiny checkpoint with LoRA, a reference (beta > 0) and num_iterations 2, padded and then packed with a
prompt's rows grouped, in turn in the processes of one launch (tests/scripts/one_launch.py); each run writes its
logged losses and grad norms, its trained weights and what it chose.

    accelerate launch --num_processes 2 --config_file accelerate_configs/zero2.yaml --mixed_precision no \
        tests/scripts/packed_exactness_train.py OUT_DIR CHECKPOINT_DIR padded packed

(or multi_gpu.yaml, zero3.yaml). A variant is ``padded`` (padding_free=False), ``packed`` (padding_free=True),
``graphs`` (padded micro-batches replayed through hf_grpo.training.graphs, "recorded" by tests/scripts/eager_recorder.py
on the CPU) or ``graphs_all_used`` (``graphs`` with ddp_find_unused_parameters=False, where DDP then does not look
for unused parameters; the Trainer's default for a LoRA model looks), ``graphs_checkpointed`` (``graphs`` with
activation checkpointing: with LoRA under ZeRO-3, TRL makes it reentrant), ``checkpointed`` (padded, activation
checkpointing on), ``checkpointed_released`` (``checkpointed`` with DeepSpeed's ZeRO-3 hooks kept, releasing
parameters between uses, as they do without hf_grpo.distributed.zero3_one_process) or ``compiled`` (``checkpointed`` with rows
packed and the decoder layers compiled, compile_training="on"; on the CPU through AOTAutograd without code
generation); each trains into
OUT_DIR/<variant>. With EXACTNESS_ON_GPU=1 the runs are on the GPU (fp32), ``graphs`` captures and replays real CUDA
graphs and ``compiled`` compiles through inductor. Prompts of 2 to 12 tokens, completions of 1 to 5, several of
each per prompt.
"""

import functools
import json
import os
import sys

import torch
from datasets import Dataset
from peft import LoraConfig
from transformers import PreTrainedTokenizerFast

from hf_grpo import GRPOConfig, GRPOTrainer, close_distributed
from hf_grpo.distributed import zero3_one_process
from hf_grpo.generation import HFGenerateBackend
from hf_grpo.generation.weight_sources import gathered
from hf_grpo.training import compiled_layers, padding_free

GROUP = 4
ON_GPU = os.environ.get("EXACTNESS_ON_GPU") == "1"
PROMPTS = ["a>", "bcdefghijk>", "c>", "defghijklmn>", "e>", "fg>", "hijklmnopq>", "r>"]


class FixedBackend(HFGenerateBackend):
    """Completions of 1-5 tokens that differ within a prompt's group (so its advantages do too)."""

    def __init__(self, tokenizer):
        super().__init__()
        self.letters = tokenizer.convert_tokens_to_ids(list("abcab"))
        self.eos = tokenizer.eos_token_id

    def generate(self, model, prompt_ids, **kwargs):
        return [[self.letters[(len(p) + row) % 5]] * ((row * 3 + len(p)) % 5) + [self.eos]
                for row, p in enumerate(prompt_ids)]


def reward(completions, **kwargs):
    return [text.count("a") / 4 for text in completions]


def count_shared_packs(counts):
    """Count the micro-batches the head packed with a prompt shared by several rows (``key_index`` set)."""
    real = padding_free.pack_rows

    def counting(*args, **kwargs):
        rows = real(*args, **kwargs)
        counts["packed"] += rows is not None
        counts["shared"] += rows is not None and rows.key_index is not None
        return rows

    padding_free.pack_rows = counting
    return real


def trained_weights(trainer) -> dict:
    model = trainer.accelerator.unwrap_model(trainer.model_wrapped)
    trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    with gathered([p for _, p in trained]):  # ZeRO-3 holds a shard of each parameter on each rank
        return {n: p.detach().clone() for n, p in trained}


def main(out_dir, checkpoint, variant):
    tokenizer = PreTrainedTokenizerFast.from_pretrained(checkpoint)
    args = GRPOConfig(
        output_dir=out_dir, report_to=[], use_cpu=not ON_GPU, bf16=False, max_steps=3, seed=3,
        per_device_train_batch_size=4, gradient_accumulation_steps=2, num_generations=GROUP, num_iterations=2,
        max_completion_length=6, beta=0.1, learning_rate=0.05, optim="sgd", lr_scheduler_type="constant",
        save_strategy="no", logging_steps=1, disable_tqdm=True,
        activation_checkpointing=variant in ("checkpointed", "checkpointed_released", "compiled",
                                             "graphs_checkpointed"),
        compile_training="on" if variant == "compiled" else "auto",
        padding_free=variant in ("packed", "compiled"),
        training_cuda_graphs="on" if variant.startswith("graphs") else "off",
        ddp_find_unused_parameters=False if variant == "graphs_all_used" else None,
    )
    make_persistent, removes_hooks = zero3_one_process.make_persistent, zero3_one_process.removes_hooks
    if variant == "checkpointed_released":  # DeepSpeed's hooks and persistence threshold, as without the trainer's
        zero3_one_process.make_persistent = lambda *args, **kwargs: None
        zero3_one_process.removes_hooks = lambda *args, **kwargs: False
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], task_type="CAUSAL_LM")
    try:
        trainer = GRPOTrainer(  # the model by its path, as users pass a checkpoint (loaded by TRL, fp32 as saved)
            model=checkpoint, reward_funcs=reward, args=args,
            train_dataset=Dataset.from_dict({"prompt": PROMPTS * 4}), processing_class=tokenizer, peft_config=lora,
        )
    finally:  # decided in the trainer's __init__: the next variant's own again
        zero3_one_process.make_persistent, zero3_one_process.removes_hooks = make_persistent, removes_hooks
    trainer.decisions.backend = FixedBackend(tokenizer)
    initial = trained_weights(trainer)
    counts = {"packed": 0, "shared": 0}
    real = count_shared_packs(counts)
    try:
        trainer.train()
    finally:
        padding_free.pack_rows = real
    rank = trainer.accelerator.process_index
    graphs = trainer.decisions.train_graphs
    timer = getattr(trainer.model_wrapped, "tput_timer", None)  # a DeepSpeed engine's
    chosen = dict(eager_rows=str(trainer.decisions.eager_rows), eager_packed=trainer.decisions.eager_rows.packed,
                  grouping=trainer.decisions.prompt_grouping, graphs_failure=graphs and graphs.failure,
                  graph_captures=graphs and graphs.captures, graphs_hand_over=graphs and graphs.hand_over,
                  ddp_find_unused=getattr(trainer.model_wrapped, "find_unused_parameters", None),
                  compiled_graphs=trainer.decisions.train_layers and trainer.decisions.train_layers.compiles,
                  compile_failure=trainer.decisions.train_layers and trainer.decisions.train_layers.failure,
                  # under ZeRO-3: how many parameters DeepSpeed keeps gathered (persistent), of how many
                  zero3_persistent=[sum(bool(getattr(p, "ds_persist", False)) for p in trainer.model.parameters()),
                                    sum(1 for _ in trainer.model.parameters())],
                  zero3_hooks_removed=trainer.facts.zero3_hooks_removed,
                  # DeepSpeed's engine: does its throughput timer wait for the device (distributed.deepspeed_timers)
                  timer_synchronized=timer.config.synchronized if timer is not None else None, **counts)
    with open(f"{out_dir}/chosen_rank{rank}.json", "w") as handle:
        json.dump(chosen, handle)
    state = trained_weights(trainer)
    if trainer.is_world_process_zero():
        torch.save({"initial": initial, "trained": state}, f"{out_dir}/params.pt")
        logged = [entry for entry in trainer.state.log_history if "loss" in entry]
        with open(f"{out_dir}/logged.json", "w") as handle:
            json.dump([{key: entry[key] for key in ("step", "loss", "grad_norm")} for entry in logged], handle)
    return trainer


if __name__ == "__main__":
    import logging

    from eager_recorder import record_eagerly  # next to this file
    from one_launch import release_for_the_next_run

    if not ON_GPU:
        record_eagerly()
        init = compiled_layers.CompiledTrainingLayers.__init__  # no C++ compiler needed on the CPU
        compiled_layers.CompiledTrainingLayers.__init__ = functools.partialmethod(
            init, backend="aot_eager_decomp_partition")

    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("hf_grpo").setLevel(logging.INFO)  # the choices the run logs (as the recipes show them)

    out, checkpoint, *variants = sys.argv[1:]
    for index, variant in enumerate(variants):
        run_dir = os.path.join(out, variant)
        os.makedirs(run_dir, exist_ok=True)
        trainer = main(run_dir, checkpoint, variant)
        if index < len(variants) - 1:
            release_for_the_next_run(trainer)
    close_distributed(trainer)
