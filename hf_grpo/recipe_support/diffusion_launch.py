"""What the diffusion recipes share: parse into a DiffuGRPOConfig, build the model, train, finish cleanly.

The same flow as ``launch.run_recipe`` (its argument precedence, presets, YAML, CPU handling and
checkpoint loader are reused), with three differences: the parser knows the diffusion fields, ``--tiny``
builds a tiny *bidirectional* model with a mask token, and a checkpoint whose ``auto_map`` registers
only ``AutoModel`` (Dream) loads through ``AutoModel``.
"""

from __future__ import annotations

from typing import Any

from trl import ModelConfig

from ..checks.inputs import check_model_path
from ..diffusion.config import DiffuGRPOConfig
from .diffusion_tiny import DEFAULT_ALPHABET, build_diffusion_tokenizer, build_tiny_diffusion_model
from .launch import parse_recipe_args, pretrained_init_kwargs, run_recipe



def parse_diffu_recipe_args(defaults: dict[str, Any], argv: list[str] | None = None):
    """(DiffuGRPOConfig, RecipeArguments, ModelConfig): flags > ``--config`` YAML > ``defaults`` > dataclass defaults."""
    return parse_recipe_args(defaults, argv, DiffuGRPOConfig)


def load_pretrained_diffusion(model_args: ModelConfig, training_args: DiffuGRPOConfig):
    """A masked-diffusion checkpoint and its tokenizer (hub id or directory; remote code with --trust_remote_code)."""
    from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

    name = model_args.model_name_or_path
    check_model_path(name)
    kwargs = pretrained_init_kwargs(model_args, training_args)
    try:
        model = AutoModelForCausalLM.from_pretrained(name, **kwargs)
    except ValueError as err:  # Dream's auto_map registers AutoModel only
        if "trust_remote_code" in str(err) and not training_args.trust_remote_code:
            raise remote_code_refused(name) from err
        if "Unrecognized configuration class" not in str(err):
            raise
        model = AutoModel.from_pretrained(name, **kwargs)
    tokenizer = AutoTokenizer.from_pretrained(name, revision=model_args.model_revision, padding_side="left",
                                              trust_remote_code=training_args.trust_remote_code)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def remote_code_refused(name: str) -> ValueError:
    """transformers' refusal of a checkpoint's own code, in the recipe's terms: the flag that allows it."""
    return ValueError(
        f"model_name_or_path={name!r} ships its own modelling code (auto_map in its config.json, as LLaDA and Dream "
        f"do), which runs only when asked: add --trust_remote_code true (or trust_remote_code: true in the --config "
        f"YAML) if you trust that code; it runs with your permissions")


def load_diffusion_model_and_tokenizer(model_args, recipe_args, training_args, alphabet: str | None = None):
    """The tiny bidirectional model built in code (``--tiny`` or no model name), else a checkpoint."""
    if recipe_args.tiny or model_args.model_name_or_path is None:
        tokenizer = build_diffusion_tokenizer(alphabet or DEFAULT_ALPHABET)
        model = build_tiny_diffusion_model(tokenizer, shape=recipe_args.tiny_shape, seed=training_args.seed)
        return model, tokenizer
    return load_pretrained_diffusion(model_args, training_args)


def run_diffu_recipe(defaults: dict[str, Any], reward_funcs, build_dataset, argv: list[str] | None = None,
                     alphabet: str | None = None):
    """Parse, build the model, train (resuming when asked), finish. Returns the trainer."""
    from ..diffusion.trainer import DiffuGRPOTrainer

    return run_recipe(defaults, reward_funcs, build_dataset, argv, alphabet, config_cls=DiffuGRPOConfig,
                      trainer_cls=DiffuGRPOTrainer, load_model=load_diffusion_model_and_tokenizer,
                      plot_title="diffu-GRPO training")
