"""Train the masked-diffusion trainer (DiffuGRPOTrainer, a tiny LLaDA-shaped model) 2 steps under the launch given,
and write what each rank saw.

    accelerate launch --num_processes 2 --config_file accelerate_configs/zero2.yaml \
        tests/scripts/diffu_zero2_train.py OUT_DIR

On CUDA it trains in bf16 (the config's mixed precision); without CUDA on CPU in fp32 (launch with
``--mixed_precision no``). Rank 0 writes OUT_DIR/result.json: the launch (processes, DeepSpeed's ZeRO stage), the
logged rows of each step, the diffusion plan, and per rank the weights' checksum before and after training (float64
sums of every parameter: ZeRO-2 replicates the parameters, so after each step every rank must hold the same ones),
its peak memory and whether its loss was finite.
"""

import json
import math
import sys

import torch
import torch.distributed as dist
from datasets import Dataset

from hf_grpo import close_distributed
from hf_grpo.diffusion import DiffuGRPOConfig, DiffuGRPOTrainer
from hf_grpo.recipe_support.diffusion_tiny import build_diffusion_tokenizer, build_tiny_diffusion_model


def reward(completions, **kwargs):
    return [len(set(text)) / 8 for text in completions]  # varies within a group: advantages are not all zero


def checksum(model: torch.nn.Module) -> float:
    return float(sum(p.detach().double().sum() for p in model.parameters()))


def main(out_dir: str) -> None:
    cuda = torch.cuda.is_available()
    tokenizer = build_diffusion_tokenizer()
    args = DiffuGRPOConfig(
        output_dir=out_dir, report_to=[], use_cpu=not cuda, bf16=cuda, max_steps=2, seed=3,
        per_device_train_batch_size=4, num_generations=4, max_completion_length=8, block_length=4, diffusion_steps=4,
        num_iterations=2, beta=0.04, learning_rate=0.05, optim="sgd", lr_scheduler_type="constant",
        save_strategy="no", logging_steps=1, disable_tqdm=True, per_device_generation_batch_size=2,
        tensor_batch_size=16,
    )
    prompts = ["ab>", "c>", "defg>", "h>", "ij>", "klmno>", "p>", "qr>"]
    trainer = DiffuGRPOTrainer(model=build_tiny_diffusion_model(tokenizer, seed=0), reward_funcs=reward, args=args,
                               train_dataset=Dataset.from_dict({"prompt": prompts * 4}), processing_class=tokenizer)
    before = checksum(trainer.model)
    trainer.train()
    live = trainer.accelerator.unwrap_model(trainer.model_wrapped)
    losses = [row["loss"] for row in trainer.state.log_history if "loss" in row]
    mine = {"rank": trainer.accelerator.process_index, "checksum_before": before, "checksum_after": checksum(live),
            "finite_loss": all(math.isfinite(loss) for loss in losses),
            "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None}
    ranks = [None] * trainer.accelerator.num_processes
    if dist.is_initialized():
        dist.all_gather_object(ranks, mine)  # a collective: every rank
    else:
        ranks = [mine]
    plugin = getattr(trainer.accelerator.state, "deepspeed_plugin", None)
    if trainer.is_world_process_zero():
        result = {
            "processes": trainer.accelerator.num_processes,
            "device": str(trainer.accelerator.device),
            "zero_stage": None if plugin is None else plugin.zero_stage,
            "diffusion_plan": args.diffusion_plan(),
            "logged": [{k: v for k, v in row.items() if isinstance(v, (int, float))}
                       for row in trainer.state.log_history if "loss" in row],
            "ranks": ranks,
        }
        with open(f"{out_dir}/result.json", "w") as handle:
            json.dump(result, handle, indent=1)
    close_distributed(trainer)


if __name__ == "__main__":
    main(sys.argv[1])
