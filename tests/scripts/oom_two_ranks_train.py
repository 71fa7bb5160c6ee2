"""Two ranks under DDP, where only rank 1 runs out of memory (injected) in generation and in the log-prob head.

    accelerate launch --num_processes 2 --config_file accelerate_configs/multi_gpu.yaml --mixed_precision no \
        tests/scripts/oom_two_ranks_train.py OUT_DIR GEN_CHUNK TENSOR_ROWS INJECT(0|1) [OUT_DIR GEN_CHUNK ...]

Rank r writes OUT_DIR/rank{r}.json (its final sizes and back-off count) and rank 0 OUT_DIR/params.pt. With
INJECT=1, rank 1's ``model.generate`` fails above 2 sequences (after sampling, so the RNG moved) and its head
above 8 rows; a run with GEN_CHUNK=2 TENSOR_ROWS=8 and INJECT=0 is what the back-off must reproduce. Several runs
(four arguments each) train in turn in the same two processes (tests/scripts/one_launch.py); an injected run
patches the head for the rest of the process, so it comes last.
"""

import json
import os
import sys

import torch
from datasets import Dataset

import hf_grpo.logprob_head
from hf_grpo import GRPOConfig, GRPOTrainer, close_distributed
from hf_grpo.recipe_support.tiny import build_char_tokenizer, build_tiny_model

TOKENIZER = build_char_tokenizer()
PROMPTS = ["ab>", "c>", "defg>", "h>", "ij>", "klmno>", "p>", "qr>"]


def reward(completions, **kwargs):
    return [text.count("a") / 4 for text in completions]


def inject(trainer):
    real_generate, real_head = trainer.model.generate, hf_grpo.logprob_head.chunked_logprobs

    def generate(*args, **kwargs):
        output = real_generate(*args, **kwargs)
        if output.size(0) > 2:
            raise torch.OutOfMemoryError("injected on rank 1 (generation)")
        return output

    def head(hidden, *args, chunk_rows, **kwargs):
        if chunk_rows is None or chunk_rows > 8:
            raise torch.OutOfMemoryError("injected on rank 1 (log-prob head)")
        return real_head(hidden, *args, chunk_rows=chunk_rows, **kwargs)

    trainer.model.generate = generate
    hf_grpo.logprob_head.chunked_logprobs = head


def main(out_dir, gen_chunk, tensor_rows, injected):
    args = GRPOConfig(
        output_dir=out_dir, report_to=[], use_cpu=True, bf16=False, max_steps=2, seed=3, logging_steps=1,
        per_device_train_batch_size=4, gradient_accumulation_steps=2, num_generations=4, max_completion_length=6,
        per_device_generation_batch_size=gen_chunk, tensor_batch_size=tensor_rows, learning_rate=0.5,
        optim="sgd", lr_scheduler_type="constant", save_strategy="no", disable_tqdm=True,
        activation_checkpointing=False, generation_backend="hf",
    )
    trainer = GRPOTrainer(model=build_tiny_model(TOKENIZER, seed=0), reward_funcs=reward, args=args,
                          train_dataset=Dataset.from_dict({"prompt": PROMPTS * 4}), processing_class=TOKENIZER)
    rank = trainer.accelerator.process_index
    if injected and rank == 1:
        inject(trainer)
    trainer.train()
    os.makedirs(out_dir, exist_ok=True)
    backoffs = sum(entry.get("perf/oom_backoffs", 0) for entry in trainer.state.log_history)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as handle:
        json.dump({"per_device_generation_batch_size": trainer.sizes.per_device_generation_batch_size,
                   "tensor_batch_size": trainer.sizes.tensor_batch_size, "oom_backoffs": backoffs,
                   "steps": trainer.state.global_step}, handle)
    if rank == 0:
        model = trainer.accelerator.unwrap_model(trainer.model)
        torch.save({n: p.detach().cpu() for n, p in model.named_parameters()}, os.path.join(out_dir, "params.pt"))
    return trainer


if __name__ == "__main__":
    from one_launch import release_for_the_next_run

    runs = [sys.argv[i:i + 4] for i in range(1, len(sys.argv), 4)]
    injected = [run[3] == "1" for run in runs]
    assert all(len(run) == 4 for run in runs) and True not in injected[:-1], "four arguments a run; injected last"
    for index, (out_dir, gen_chunk, tensor_rows, inject_flag) in enumerate(runs):
        trainer = main(out_dir, int(gen_chunk), int(tensor_rows), inject_flag == "1")
        if index < len(runs) - 1:
            release_for_the_next_run(trainer)
    close_distributed()
