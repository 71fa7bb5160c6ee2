"""Train GRPO under ZeRO-3 with the dense generation mirror forced on, then check the mirror against the model.

    accelerate launch --num_processes 2|1 --config_file accelerate_configs/zero3.yaml --mixed_precision no \
        tests/scripts/zero3_dense_mirror.py OUT_DIR plain|lora-tied [plain|lora-tied]

``lora-tied``: LoRA adapters on a model whose input and output embeddings are one tensor. Each variant trains in
turn in the same two processes (tests/scripts/one_launch.py), into OUT_DIR/<variant>.
On CPU the "hf" backend generates (the cuda_graph one needs CUDA); what is checked is the mirror path:
every rollout generates from the mirror, no gather is larger than one unit (a decoder layer, the
embeddings, ...), and after the last optimizer step a refresh writes the weights into the mirror, whose values
then equal the fully gathered model's (through PEFT's own merge under LoRA). ``plain`` frees the copy after each
rollout (``release_generation_memory``, the default): the run ends holding none of it, and the refresh fills it
again. ``lora-tied`` keeps it (a LoRA run peaks in its rollouts): the refresh writes into the same tensors. With
one process the partitions hold the whole weights and the decoder reads them in place: no copy, the adapters merged
into them for the rollout and the base weights restored after. Writes OUT_DIR/<variant>/result.json on rank 0; any
failed check exits non-zero.
"""

import json
import math
import os
import sys

import deepspeed
import torch
from datasets import Dataset
from transformers import Qwen2ForCausalLM

from hf_grpo import GRPOConfig, GRPOTrainer, close_distributed
from hf_grpo.generation import HFGenerateBackend
from hf_grpo.recipe_support.tiny import build_char_tokenizer, build_tiny_model

TOKENIZER = build_char_tokenizer()

# Every GatheredParameters context opened during the run, by elements gathered, and the models generated from.
GATHERS: list[int] = []
GENERATED_FROM: list[torch.nn.Module] = []


class RecordingGather(deepspeed.zero.GatheredParameters):
    def __init__(self, params, *args, **kwargs):
        params = list(params) if not isinstance(params, torch.Tensor) else [params]
        GATHERS.append(sum(getattr(p, "ds_numel", p.numel()) for p in set(params)))
        super().__init__(params, *args, **kwargs)


class RecordingBackend(HFGenerateBackend):
    def generate(self, model, prompt_ids, **kwargs):
        GENERATED_FROM.append(model)
        return super().generate(model, prompt_ids, **kwargs)


def reward(completions, **kwargs):
    return [text.count("a") / 4 for text in completions]


def build(tied: bool, seed: int):
    model = build_tiny_model(TOKENIZER, seed=seed)
    if not tied:
        return model
    config = model.config
    config.tie_word_embeddings = True
    torch.manual_seed(seed)
    tied_model = Qwen2ForCausalLM(config)  # lm_head.weight is model.embed_tokens.weight
    tied_model.generation_config = model.generation_config
    return tied_model


def reference_logits(live, state, lora: bool, input_ids):
    """A model built outside ZeRO holding the gathered ``state``; under LoRA merged by PEFT's merge_and_unload."""
    model = build(lora, seed=1)  # other initial weights: every value must come from ``state``
    if lora:
        from peft import get_peft_model

        model = get_peft_model(model, live.peft_config["default"])
    model.load_state_dict(state)
    if lora:
        model = model.merge_and_unload()
    return model.eval()(input_ids).logits


def main(out_dir: str, lora: bool) -> GRPOTrainer:
    deepspeed.zero.GatheredParameters = RecordingGather
    del GATHERS[:], GENERATED_FROM[:]  # this run's only
    args = GRPOConfig(
        output_dir=out_dir, report_to=[], use_cpu=True, bf16=False, max_steps=2, seed=3,
        per_device_train_batch_size=4, num_generations=4, max_completion_length=6, temperature=1.0,
        learning_rate=0.05, optim="sgd", lr_scheduler_type="constant", save_strategy="no", logging_steps=1,
        disable_tqdm=True, activation_checkpointing=False, zero3_generation_mirror="on", generation_backend="hf",
    )
    peft_config = None
    if lora:
        from peft import LoraConfig

        peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
    prompts = ["ab>", "c>", "defg>", "h>", "ij>", "klmno>", "p>", "qr>"]
    trainer = GRPOTrainer(
        model=build(lora, seed=0), reward_funcs=reward, args=args, peft_config=peft_config,
        train_dataset=Dataset.from_dict({"prompt": prompts * 4}), processing_class=TOKENIZER,
    )
    trainer.decisions.backend = RecordingBackend()
    trainer.train()

    live = trainer.accelerator.unwrap_model(trainer.model_wrapped)
    mirror = trainer.decisions.mirror.mirror
    assert mirror is not None, f"no mirror: {trainer.decisions.mirror}"
    assert GENERATED_FROM and all(model is mirror.module for model in GENERATED_FROM), "a rollout bypassed the mirror"
    assert not any(hasattr(p, "ds_id") for p in mirror.module.parameters()), "the mirror holds ZeRO-3 parameters"
    # LoRA layers are merged away: the mirror is the plain architecture
    assert not any("lora" in name for name, _ in mirror.module.named_parameters())
    assert (mirror.module.lm_head.weight is mirror.module.model.embed_tokens.weight) == lora  # tied stays tied
    losses = [row["loss"] for row in trainer.state.log_history if "loss" in row]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses), trainer.state.log_history

    # The largest unit: a decoder layer as ZeRO-3 holds it (with its LoRA weights), or a module outside the layers.
    layers = live.get_base_model().model.layers if lora else live.model.layers
    largest_layer = max(sum(p.ds_numel for p in layer.parameters()) for layer in layers)
    total = sum(p.ds_numel for p in live.parameters())
    assert max(GATHERS, default=0) <= largest_layer < total, (GATHERS, largest_layer, total)  # in place: none

    # One process holds every partition whole: the decoder reads them in place (no copy), elsewhere a dense mirror.
    in_place = trainer.decisions.mirror.in_place
    assert in_place == (trainer.accelerator.num_processes == 1), trainer.decisions.mirror
    if in_place:
        partitions = {p.ds_tensor.untyped_storage().data_ptr() for p in live.parameters()}
        assert all(p.untyped_storage().data_ptr() in partitions for p in mirror.module.parameters())

    # A plain model's dense copy released its memory after the last rollout (release_generation_memory, the
    # default); a LoRA run's kept it: the refresh writes the new values into the same tensors. Read in place, the
    # values are there before the refresh, which then only merges the adapters.
    freed = trainer.decisions.mirror.freed_between_rollouts
    assert freed == (not lora and not in_place), trainer.decisions.mirror
    if not in_place:
        assert (mirror.resident_nbytes == 0) == freed, f"{mirror.resident_nbytes} bytes held after the run"
    params = list(mirror.module.parameters())
    pointers = [p.data_ptr() for p in params]
    before = None if freed else [p.detach().clone() for p in params]
    del GATHERS[:]
    mirror.refresh(live)
    refresh_gathers = list(GATHERS)
    assert list(mirror.module.parameters()) == params, "the refresh replaced a mirror parameter"
    if freed:
        assert mirror.resident_nbytes == sum(p.numel() * p.element_size() for p in params), "not filled again"
    else:
        assert [p.data_ptr() for p in params] == pointers, "the refresh moved a mirror tensor"
        changed = sum(not torch.equal(a, p) for a, p in zip(before, params))
        assert changed > 0 or (in_place and not lora), "the optimizer step did not reach the mirror"
    input_ids = torch.tensor([TOKENIZER.encode("abc> de")] * 2)
    with torch.no_grad():
        got = mirror.module(input_ids).logits
    mirror.restore()  # in place: the base weights unmerged before the model is read again

    with deepspeed.zero.GatheredParameters(list(live.parameters())):
        state = {name: tensor.clone() for name, tensor in live.state_dict().items()}  # tied: under both names
    with torch.no_grad():
        expected = reference_logits(live, state, lora, input_ids)
    assert torch.equal(got, expected), (got - expected).abs().max()

    if trainer.is_world_process_zero():
        plan = trainer.batch_plan()
        with open(f"{out_dir}/result.json", "w") as handle:
            json.dump({"losses": losses, "gathers_per_refresh": len(refresh_gathers), "in_place": in_place,
                       "freed_between_rollouts": freed,
                       "mirror": plan.generation_mirror, "mirror_bytes": plan.generation_mirror_bytes,
                       "plan": str(plan)}, handle)
    return trainer


if __name__ == "__main__":
    from one_launch import release_for_the_next_run

    variants = sys.argv[2:]
    for index, variant in enumerate(variants):
        assert variant in ("plain", "lora-tied"), variant
        run_dir = os.path.join(sys.argv[1], variant)
        os.makedirs(run_dir, exist_ok=True)
        trainer = main(run_dir, lora=variant == "lora-tied")
        if index < len(variants) - 1:
            release_for_the_next_run(trainer)
    close_distributed(trainer)
