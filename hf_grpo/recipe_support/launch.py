"""What every recipe does around its task: parse arguments, build the model, finish cleanly."""

from __future__ import annotations

import importlib.util
import logging
import math
import os
import pathlib
import sys
from collections.abc import Collection
from typing import Any

import torch
import yaml
from trl import ModelConfig, TrlParser, get_peft_config, get_quantization_config

from ..checks import output_lock
from ..checks.inputs import check_model_path
from ..config import GRPOConfig, device_defaults, explicit_fields
from ..distributed import before_deepspeed_starts, prepare_process
from ..distributed.shutdown import close_distributed
from ..trainer import GRPOTrainer
from .config_file import check_integer_values, read_config_file
from .recipe_args import RecipeArguments
from .reporting import METRICS_FILE, PLOT_FILE, plot_metrics
from .tasks import as_chat
from .tiny import build_char_tokenizer, build_tiny_model

logger = logging.getLogger("hf_grpo")


def recipe_defaults(recipe_file: str, launch_only: Collection[str] = ()) -> dict[str, Any]:
    """A recipe's defaults, read from the YAML beside it (``recipes/<name>.yaml``): its settings are written there
    once. ``launch_only`` names the keys the YAML sets for the launch its first line names (bf16 weights,
    accumulation, chunk sizes, a seed) that a run without ``--config`` leaves at the library's defaults."""
    path = pathlib.Path(recipe_file).with_suffix(".yaml")
    values = yaml.safe_load(path.read_text())
    unknown = sorted(set(launch_only) - set(values))
    if unknown:
        raise ValueError(f"launch_only names {unknown}, which {path} does not set; its keys: {sorted(values)}")
    return {name: value for name, value in values.items() if name not in launch_only}


def parse_recipe_args(defaults: dict[str, Any], argv: list[str] | None = None, config_cls: type = GRPOConfig):
    """(config, RecipeArguments, ModelConfig) from ``--config FILE.yaml`` and flags; ``config_cls`` is
    ``GRPOConfig`` or a subclass (``DiffuGRPOConfig``).

    Precedence: flags > YAML > the recipe's ``defaults`` > dataclass defaults; the DIFFU_*
    environment variables win over all of them (GRPOConfig applies them).
    """
    logging.basicConfig(format="%(asctime)s %(name)s: %(message)s", level=logging.WARNING)
    logger.setLevel(logging.INFO)
    prepare_process()  # the launcher watch; a launcher's bf16 off on a CPU, before the config reads it
    before_deepspeed_starts()  # before the config is built: that may build a DeepSpeed op
    parser = TrlParser((config_cls, RecipeArguments, ModelConfig))
    # YAML values become argparse defaults, which argparse does not convert: a float for an integer field is refused
    check_integer_values(defaults, parser.dataclass_types, "the recipe's defaults")
    unknown = parser.set_defaults_with_config(**{**device_defaults(), **defaults})
    if unknown:
        raise ValueError(f"recipe defaults name unknown fields: {unknown[::2]}")
    argv = sys.argv[1:] if argv is None else list(argv)
    flags, yaml_keys = flag_fields(argv), yaml_fields(argv, parser.dataclass_types)
    # A preset fills only what the user left out: the YAML's keys and the flags, not the recipe's defaults.
    with explicit_fields(flags | yaml_keys):
        training_args, recipe_args, model_args = parser.parse_args_and_config(args=argv)
    choose_model_source(recipe_args, model_args, flags, yaml_keys)
    return training_args, recipe_args, model_args


def choose_model_source(recipe_args: RecipeArguments, model_args: ModelConfig, flags: set[str],
                        yaml_keys: set[str]) -> None:
    """``tiny`` or ``model_name_or_path``, by the precedence of where each was set (flag > YAML > recipe
    default): a checkpoint named on the command line wins over the quickstarts' default ``tiny=True`` (which
    silently ignored it before); both set at the same level is a contradiction, refused."""
    if not recipe_args.tiny or model_args.model_name_or_path is None:
        return

    def level(name: str) -> int:
        return 2 if name in flags else 1 if name in yaml_keys else 0

    tiny, checkpoint = level("tiny"), level("model_name_or_path")
    if tiny == checkpoint:
        where = {2: "on the command line", 1: "in the --config YAML", 0: "in the recipe's defaults"}[tiny]
        raise ValueError(
            f"tiny=True and model_name_or_path={model_args.model_name_or_path!r} are both set {where} and "
            f"contradict each other: tiny builds a random model in code instead of loading one; drop tiny to "
            f"train the checkpoint, or drop model_name_or_path to train the tiny model"
        )
    if checkpoint > tiny:
        recipe_args.tiny = False


def flag_fields(argv: list[str]) -> set[str]:
    """Field names set by ``--flag`` on the command line."""
    return {token[2:].split("=", 1)[0] for token in argv if token.startswith("--")} - {"config"}


def yaml_fields(argv: list[str], classes: Collection[type] = ()) -> set[str]:
    """Field names set as keys of the ``--config`` YAML; a file that is not a YAML mapping, or a float for an integer
    field of ``classes``, is an error naming the file (``config_file``)."""
    names: set[str] = set()
    for index, token in enumerate(argv):
        path = token.split("=", 1)[1] if token.startswith("--config=") else (
            argv[index + 1] if token == "--config" and index + 1 < len(argv) else None)
        if path is not None:
            values = read_config_file(path)
            check_integer_values(values, classes, f"--config {path}")
            names |= set(values)
    return names - {"config"}


def load_model_and_tokenizer(model_args: ModelConfig, recipe_args: RecipeArguments, training_args: GRPOConfig,
                             alphabet: str | None = None):
    """The tiny in-code model (``--tiny`` or no model name), else a checkpoint: a hub id or a local directory."""
    if recipe_args.tiny or model_args.model_name_or_path is None:
        tokenizer = build_char_tokenizer(alphabet) if alphabet else build_char_tokenizer()
        # with beta > 0 the trainer gives TRL a copy to load the reference model from (hf_grpo.reference_copy)
        return build_tiny_model(tokenizer, shape=recipe_args.tiny_shape, seed=training_args.seed), tokenizer
    return load_pretrained(model_args, training_args)


def pretrained_init_kwargs(model_args: ModelConfig, training_args: GRPOConfig) -> dict[str, Any]:
    """``from_pretrained`` keyword arguments from TRL's ModelConfig; quantization through TRL's helpers.

    ``trust_remote_code`` is GRPOConfig's (TRL's) field, so the reference model TRL builds from the
    same path reads the same value.
    """
    dtype = model_args.dtype if model_args.dtype in ("auto", None) else getattr(torch, model_args.dtype)
    kwargs: dict[str, Any] = dict(
        revision=model_args.model_revision,
        trust_remote_code=training_args.trust_remote_code,
        attn_implementation=model_args.attn_implementation,
        dtype=dtype,
    )
    quantization = _quantization_config(model_args)
    if quantization is not None:
        # a quantized model is placed at load time, each process on its own GPU
        kwargs.update(quantization_config=quantization, device_map={"": int(os.environ.get("LOCAL_RANK", "0"))})
    return kwargs


def _quantization_config(model_args: ModelConfig):
    """TRL's BitsAndBytes config for ``--load_in_4bit`` / ``--load_in_8bit``, or None; refused where it cannot run."""
    flag = "load_in_4bit" if model_args.load_in_4bit else "load_in_8bit" if model_args.load_in_8bit else None
    if flag is None:
        return None
    if not torch.cuda.is_available():
        raise ValueError(f"{flag}=True needs a CUDA GPU (bitsandbytes quantizes on the GPU); this machine has "
                         f"none: drop --{flag}")
    if not model_args.use_peft:
        raise ValueError(f"{flag}=True trains a quantized model, whose weights cannot be updated directly: add "
                         f"--use_peft true (LoRA adapters train on top of the quantized weights) or drop --{flag}")
    if importlib.util.find_spec("bitsandbytes") is None:
        raise ValueError(f"{flag}=True needs the bitsandbytes package: pip install bitsandbytes, or drop --{flag}")
    return get_quantization_config(model_args)


def load_pretrained(model_args: ModelConfig, training_args: GRPOConfig):
    """A model and its tokenizer from ``model_name_or_path``: a hub id or a ``save_pretrained`` directory."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    name = model_args.model_name_or_path
    check_model_path(name)
    model = AutoModelForCausalLM.from_pretrained(name, **pretrained_init_kwargs(model_args, training_args))
    tokenizer = AutoTokenizer.from_pretrained(
        name, revision=model_args.model_revision, padding_side="left",
        trust_remote_code=training_args.trust_remote_code,
    )
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def chat_prompts_if_templated(dataset, tokenizer):
    """Chat models get each prompt as a user turn (TRL applies their template); others keep plain text."""
    if not tokenizer.chat_template:
        return dataset
    return dataset.map(lambda row: {"prompt": as_chat(row["prompt"])})


def run_recipe(defaults: dict[str, Any], reward_funcs, build_dataset, argv: list[str] | None = None,
               alphabet: str | None = None, *, config_cls: type = GRPOConfig, trainer_cls: type = GRPOTrainer,
               load_model=None, plot_title: str | None = None):
    """Parse, build the model, train (resuming when asked), finish. Returns the trainer.

    ``build_dataset(recipe_args, training_args, tokenizer)`` returns the training dataset. The diffusion
    recipes pass their config and trainer classes and their model loader
    (``load_model(model_args, recipe_args, training_args, alphabet)``).
    """
    training_args, recipe_args, model_args = parse_recipe_args(defaults, argv, config_cls)
    model, tokenizer = (load_model or load_model_and_tokenizer)(model_args, recipe_args, training_args, alphabet)
    trainer = trainer_cls(
        model=model,
        reward_funcs=reward_funcs,
        args=training_args,
        train_dataset=build_dataset(recipe_args, training_args, tokenizer),
        processing_class=tokenizer,
        peft_config=get_peft_config(model_args),
    )
    # the folder is held from the first step to the final model and performance.json (hf_grpo.checks.output_lock)
    with output_lock.held_for_run(training_args.output_dir, trainer.accelerator):
        trainer.train(resume_from_checkpoint=resume_argument(training_args.resume_from_checkpoint))
        finish(trainer, recipe_args, plot_title)
    return trainer


def resume_argument(value: str | None) -> str | bool | None:
    """``--resume_from_checkpoint`` as ``Trainer.train`` takes it: ``true`` resumes from the latest checkpoint in
    output_dir (the flag arrives as text, which the Trainer would read as a directory named "true")."""
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true" or None
    return value


def _rounded(value):
    """Stats for the log line: floats to 4 places, nested dicts (memory figures) likewise."""
    if isinstance(value, float):
        return round(value, 4) if math.isfinite(value) else value
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    return value


def finish(trainer, recipe_args: RecipeArguments, plot_title: str | None = None) -> None:
    """Save the model and the plot; end the distributed run. (``metrics.jsonl`` and ``performance.json`` are
    the trainer's: ``hf_grpo.run_files``.)"""
    trainer.save_model()
    output_dir = trainer.args.output_dir
    if trainer.is_world_process_zero():
        metrics = os.path.join(output_dir, METRICS_FILE)
        if recipe_args.plot and os.path.exists(metrics):
            png = plot_metrics(metrics, os.path.join(output_dir, PLOT_FILE),
                               **({"title": plot_title} if plot_title else {}))
            logger.info("metrics: %s, plot: %s", metrics, png)
        stats = trainer.get_performance_stats()
        logger.info("performance (rank 0): %s", _rounded({k: v for k, v in stats.items() if k != "batch_plan"}))
    close_distributed(trainer)
