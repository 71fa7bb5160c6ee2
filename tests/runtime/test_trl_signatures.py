"""The TRL methods hf-grpo's trainers override or call keep the signatures they were written against.

They are mostly private methods of ``trl.GRPOTrainer``, whose signatures changed in most minor releases
(``_get_per_token_logps_and_entropies`` returned three values from 1.7 on; ``_generate`` changed in 1.0, 1.3
and 1.9). Raising the TRL pin fails here first, naming the method that changed, instead of deep inside a
training step. Parameter names, kinds and defaults are compared; annotations are not (they name classes of
transformers and datasets, which move on their own).
"""

from __future__ import annotations

import inspect

import pytest
import trl

from hf_grpo.diffusion.trainer import DiffuGRPOTrainer
from hf_grpo.runtime import upstream
from hf_grpo.trainer import GRPOTrainer

WRITTEN_AGAINST = "1.16.0"

# trl.GRPOTrainer's signatures, read off trl 1.16.0.
RECORDED = {
    "__init__": "(self, model, reward_funcs=None, args=None, train_dataset=None, eval_dataset=None, "
                "processing_class=None, reward_processing_classes=None, callbacks=None, optimizers=(None, None), "
                "quantization_config=None, peft_config=None, tools=None, rollout_func=None, environment_factory=None)",
    "_calculate_rewards": "(self, inputs, prompts, completions, completion_ids_list)",
    "_compute_loss": "(self, model, inputs)",
    "_generate_and_score_completions": "(self, inputs)",
    "_generate_single_turn": "(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False)",
    "_get_per_token_logps_and_entropies": "(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None, "
                                          "compute_entropy=False, compute_aux_loss=False, pixel_values=None, "
                                          "image_grid_thw=None, num_images=None, pixel_attention_mask=None, "
                                          "spatial_shapes=None, num_tiles=None, image_sizes=None, "
                                          "token_type_ids=None, mm_token_type_ids=None, image_position_ids=None)",
    "_prepare_inputs": "(self, generation_batch)",
    # transformers' Trainer's (transformers 5.24): overridden, and the loaders its override calls
    "_prepare_for_training": "(self, max_steps, train_dataloader, resume_from_checkpoint)",
    "_init_training_state": "(self, max_steps, num_update_steps_per_epoch, num_train_epochs, resume_from_checkpoint, "
                            "trial)",
    "_load_from_checkpoint": "(self, resume_from_checkpoint, model=None)",
    "_load_optimizer_and_scheduler": "(self, checkpoint)",
    "_load_scaler": "(self, checkpoint)",
    "_get_output_dir": "(self, trial)",  # transformers' Trainer's (transformers 5.25)
    "_save_rng_state": "(self, output_dir)",  # transformers' Trainer's (transformers 5.24)
    "_save_checkpoint": "(self, model, trial)",  # transformers' Trainer's (transformers 5.25)
    "_tokenize_prompts": "(self, prompts)",
    "compute_loss": "(self, model, inputs, return_outputs=False, num_items_in_batch=None)",
    "create_accelerator_and_postprocess": "(self)",
    "log": "(self, logs, start_time=None)",
    "train": "(self, resume_from_checkpoint=None, trial=None, ignore_keys_for_eval=None)",
    "training_step": "(self, model, inputs, num_items_in_batch)",
}
# Called, not overridden (through hf_grpo.runtime.upstream): a checkpoint without ZeRO state resumed under ZeRO-1/2
# is loaded with the Trainer's loaders (distributed.plain_to_zero); a failed save names the checkpoint directory.
CALLED_ONLY = {name.name for name in upstream.NAMES if name.owner in ("trainer", "trl.GRPOTrainer")
               and callable(getattr(trl.GRPOTrainer, name.name, None))} - set(upstream.OVERRIDDEN)


def shape(function) -> str:
    """The signature without annotations: names, kinds (``*``, ``**``, keyword-only) and defaults."""
    signature = inspect.signature(function)
    bare = [p.replace(annotation=inspect.Parameter.empty) for p in signature.parameters.values()]
    return str(signature.replace(parameters=bare, return_annotation=inspect.Signature.empty))


def overridden(cls: type) -> set[str]:
    """Methods ``cls`` itself defines that trl.GRPOTrainer (or transformers' Trainer below it) also has."""
    return {name for name, value in vars(cls).items() if callable(value) and hasattr(trl.GRPOTrainer, name)}


@pytest.mark.parametrize("name", sorted(RECORDED))
def test_the_trl_method_keeps_the_signature_it_was_written_against(name):
    now = shape(getattr(trl.GRPOTrainer, name))
    assert now == RECORDED[name], (
        f"trl.GRPOTrainer.{name} changed between trl {WRITTEN_AGAINST} and trl {trl.__version__}:\n"
        f"  recorded: {RECORDED[name]}\n  now:      {now}\n"
        f"hf-grpo overrides or calls it (hf_grpo/trainer.py, hf_grpo/diffusion/trainer.py): adapt them, then "
        f"record the new signature here"
    )


@pytest.mark.parametrize("cls", [GRPOTrainer, DiffuGRPOTrainer], ids=lambda cls: cls.__name__)
def test_every_trl_method_the_trainers_override_has_a_recorded_signature(cls):
    """A new override of a TRL method is recorded above, so that the next pin raise checks it too."""
    unrecorded = overridden(cls) - set(RECORDED)
    assert not unrecorded, (
        f"{cls.__name__} overrides TRL's {sorted(unrecorded)} with no signature recorded in {__name__}: add "
        f"each one's trl {trl.__version__} signature (shape(trl.GRPOTrainer.<name>)) to RECORDED"
    )


def test_the_recorded_methods_are_the_ones_overridden_or_called():
    """No stale entries: each recorded method is overridden by one of the trainers or called by them."""
    used = overridden(GRPOTrainer) | overridden(DiffuGRPOTrainer) | CALLED_ONLY
    assert set(RECORDED) == used


def test_the_private_overrides_are_the_ones_hf_grpo_runtime_upstream_lists():
    """hf_grpo/runtime/upstream.py lists the private methods the trainers override (its scan lets only them pass)."""
    private = {name for name in overridden(GRPOTrainer) | overridden(DiffuGRPOTrainer) if name.startswith("_")
               and not name.endswith("__")}
    assert private == set(upstream.OVERRIDDEN)
    assert CALLED_ONLY == {"_get_output_dir", "_load_from_checkpoint", "_load_optimizer_and_scheduler", "_load_scaler"}
