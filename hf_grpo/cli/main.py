"""Command line: ``hf-grpo plan`` prints the batch plan of a config without loading a model."""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
import sys
from collections.abc import Sequence

import yaml

from ..config import BATCH_FIELDS, GRPOConfig, batch_field_defaults, resolve_batch_fields
from ..plan import BatchPlan
from . import bounded_yaml


def _known_yaml_keys() -> set[str]:
    """Keys a recipe YAML may hold: fields of the config and of the recipe's other dataclasses."""
    from trl import ModelConfig, ScriptArguments

    from ..diffusion.config import DiffuGRPOConfig
    from ..recipe_support.recipe_args import RecipeArguments

    keys = set()
    for cls in (GRPOConfig, DiffuGRPOConfig, ModelConfig, ScriptArguments, RecipeArguments):
        keys |= {f.name for f in dataclasses.fields(cls)}
    return keys


# Keys every Accelerate launch config (`accelerate config`'s output) holds: such a file is for `accelerate launch`.
ACCELERATE_CONFIG_KEYS = frozenset({"compute_environment", "distributed_type"})


def load_yaml(path: str, holds: str):
    """The YAML file's content; a syntax error is one line naming the file, the line and column, and the problem.
    An empty file (or one of comments only) is an error too: the plan it would print is the defaults', not the
    file's ``holds``, which the user meant to read."""
    with open(path) as handle:
        try:
            loaded = bounded_yaml.safe_load(handle)  # an alias bomb refused, not walked (bounded_yaml)
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            problem = getattr(err, "problem", None) or str(err).splitlines()[0]
            raise ValueError(f"{path} is not valid YAML{where}: {problem}") from None
        except UnicodeDecodeError as err:  # (a binary file: the decoder's message names no file)
            raise ValueError(f"{path} is not a text file (byte {err.start} is not UTF-8); --config takes {holds}") \
                from None
    if loaded is None:
        raise ValueError(f"{path} is empty (no keys); --config takes {holds}")
    return loaded


def check_recipe_keys(path: str, loaded: dict) -> None:
    """Keys a recipe YAML may not hold: an Accelerate config is named as such, a typo gets "did you mean"."""
    if ACCELERATE_CONFIG_KEYS <= set(loaded):
        raise ValueError(
            f"{path} is an Accelerate launch config (it has {', '.join(sorted(ACCELERATE_CONFIG_KEYS))}), not a "
            f"recipe config: give it to `accelerate launch --config_file {path}`; `hf-grpo plan --config` takes a "
            f"recipe YAML of hf_grpo.GRPOConfig fields, and --num_processes N for the launch's processes")
    known = _known_yaml_keys()
    unknown = sorted(set(loaded) - known)
    if unknown:
        hints = [f"{key!r} (did you mean {near[0]!r}?)" if (near := difflib.get_close_matches(key, known, n=1))
                 else repr(key) for key in unknown]
        raise ValueError(f"{path}: unknown keys [{', '.join(hints)}]; they are not fields of hf_grpo.GRPOConfig "
                         f"or of the recipe's arguments")


def framework_flags_as_settings(argv: Sequence[str], own_flags: Sequence[str]) -> list[str]:
    """A framework's own command line in ``KEY=VALUE`` form, as OpenRLHF users type it: ``--key value`` and
    ``--key=value`` give ``key=value``; a bare ``--flag`` (a switch: next comes another flag, a ``KEY=VALUE`` or
    nothing) gives ``flag=true``. ``own_flags`` (``--from``, ``--config``, ...) and their values are left as given."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        token, following = argv[i], argv[i + 1] if i + 1 < len(argv) else None
        name = token.split("=", 1)[0]
        takes_next = "=" not in token and following is not None
        if name in own_flags or not token.startswith("--"):
            out.append(token)
            if name in own_flags and takes_next and name not in ("--help", "-h"):
                out.append(following)  # the flag's value
                i += 1
        elif "=" in token:
            out.append(token[2:])
        elif takes_next and not following.startswith("--") and "=" not in following:
            out.append(f"{token[2:]}={following}")
            i += 1
        else:
            out.append(f"{token[2:]}=true")
        i += 1
    return out


def _int_or_none(text: str) -> int | str | None:
    if text.lower() == "auto":  # per_device_train_batch_size, per_device_generation_batch_size, tensor_batch_size
        return "auto"
    return None if text.lower() in ("none", "null") else int(text)


def _true_or_false(text: str) -> bool:
    if text.lower() not in ("true", "false"):
        raise argparse.ArgumentTypeError(f"true or false, got {text!r}")
    return text.lower() == "true"


def build_plan(argv: Sequence[str]) -> BatchPlan:
    """Parse ``hf-grpo plan`` arguments into a validated BatchPlan (raises ValueError)."""
    return _parse_plan(argv)[0]


def _parse_plan(argv: Sequence[str]) -> tuple[BatchPlan, argparse.Namespace, dict]:
    """The validated plan, the parsed flags and the YAML's keys (``{}`` without ``--config``)."""
    defaults = batch_field_defaults()
    parser = argparse.ArgumentParser(
        prog="hf-grpo plan",
        description="Print the batch plan (per-device and global sizes) for a GRPO config. No model is loaded.",
    )
    parser.add_argument("--config", help="a recipe YAML; flags given here override its values")
    from .translate import FRAMEWORKS

    parser.add_argument("--from", dest="framework", choices=list(FRAMEWORKS),  # served by translate_plan
                        help="translate that framework's batch settings (KEY=VALUE ...) into hf-grpo flags and print "
                        "their plan (see: hf-grpo plan --from FRAMEWORK --help)")
    parser.add_argument("--num_processes", type=int, default=1, help="data-parallel processes (default: 1)")
    parser.add_argument("--preset", choices=["memory", "balanced", "speed"], default=None)
    for name in BATCH_FIELDS:
        if name in ("preset", "bf16") or "checkpointing" in name:
            continue
        parser.add_argument(f"--{name}", type=_int_or_none, default=None, help=f"default: {defaults[name]}")
    fit = parser.add_argument_group("memory", "with --model_config: the longest completion the sizes fit on a "
                                    "device (hf_grpo.memory.context_fit)")
    fit.add_argument("--model_config", help="the model's config.json (or its directory), or a shape of "
                     "hf_grpo.recipe_support.tiny.SHAPES (e.g. 7b)")
    fit.add_argument("--device_memory_gib", type=float, help="the device's memory (default: this machine's GPU)")
    fit.add_argument("--max_completion_length", type=int, help="default: the YAML's, else GRPOConfig's")
    fit.add_argument("--longest_prompt", type=int, default=None, help="tokens (default: the YAML's "
                     "max_prompt_length, else 512)")
    fit.add_argument("--lora_r", type=int, default=None, help="LoRA rank, 0 for full fine-tuning (default: the "
                     "YAML's lora_r where use_peft is true, else 0)")
    fit.add_argument("--activation_checkpointing", type=_true_or_false, default=None,
                     help="true or false (default: the YAML's or the preset's, else false)")
    args = parser.parse_args(argv)

    values = dict(defaults)
    loaded = {}
    if args.config:
        loaded = load_yaml(args.config, "a recipe YAML of hf_grpo.GRPOConfig fields")
        if not isinstance(loaded, dict):
            raise ValueError(f"{args.config} must hold a mapping of config fields, got {type(loaded).__name__}")
        check_recipe_keys(args.config, loaded)
        values.update({k: v for k, v in loaded.items() if k in BATCH_FIELDS})
    given = {k: v for k, v in vars(args).items() if k in BATCH_FIELDS and v is not None}
    values.update(given)
    explicit = set(given) | (set(loaded) if args.config else set())
    if args.num_processes < 1:
        raise ValueError(f"--num_processes must be >= 1, got {args.num_processes}")
    resolved = resolve_batch_fields(values, explicit, args.num_processes)
    return BatchPlan.from_fields(resolved, args.num_processes), args, {**loaded, **resolved}


def plan_text(argv: Sequence[str]) -> tuple[str, str | None]:
    """``hf-grpo plan``'s output: the batch plan, and with ``--model_config`` the longest completion that fits; and
    the error the trainer would raise at train begin where the run cannot fit, else None."""
    plan, args, values = _parse_plan(argv)
    if not args.model_config:
        return str(plan), None
    text, refusal = fit_text(plan, args, values)
    return f"{plan}\n{text}", refusal


def fit_text(plan: BatchPlan, args: argparse.Namespace, values: dict) -> tuple[str, str | None]:
    """The memory estimate's paragraph for the plan's sizes (``context_fit.summary``), and the refusal a run it
    says cannot fit gets at train begin (``context_fit.refusal``), else None."""
    from ..memory import context_fit
    from ..recipe_support.tiny import SHAPES

    config = ({**SHAPES[args.model_config], "model_type": "qwen2"} if args.model_config in SHAPES
              else context_fit.read_model_config(args.model_config))
    if config.get("vocab_size") is None:
        raise ValueError(f"--model_config {args.model_config}: the shape has no vocabulary size; give a config.json")
    dims = context_fit.ModelDims.from_config(config)
    device = args.device_memory_gib
    if device is None:
        import torch

        if not torch.cuda.is_available():
            raise ValueError("--model_config needs --device_memory_gib (no GPU on this machine to read it from)")
        device = torch.cuda.get_device_properties(0).total_memory / 2**30
    defaults = {f.name: f.default for f in dataclasses.fields(GRPOConfig)}
    completion = args.max_completion_length or values.get("max_completion_length") or defaults["max_completion_length"]
    lora = args.lora_r if args.lora_r is not None else (values.get("lora_r", 16) if values.get("use_peft") else 0)
    beta = values.get("beta", defaults["beta"])
    shape = context_fit.RunShape(
        prompt=args.longest_prompt or values.get("max_prompt_length") or 512,
        generation_rows=plan.per_device_generation_batch_size, train_rows=plan.per_device_train_batch_size,
        tensor_rows=plan.tensor_batch_size, token_budget=plan.max_tokens_per_micro_batch, lora_rank=lora,
        checkpointing=bool(values.get("activation_checkpointing")), reference_copy=not lora and beta != 0,
        packed=values.get("padding_free") is not False,
        backend="hf" if values.get("generation_backend") == "hf" else "cuda_graph")
    for name, value in (("--max_completion_length", completion), ("--longest_prompt", shape.prompt),
                        ("--lora_r", lora), ("--device_memory_gib", device)):
        if value < (0 if name in ("--lora_r", "--longest_prompt") else 1e-9):
            raise ValueError(f"{name} must be positive, got {value}")
    text, fits = context_fit.summary(dims, shape, int(device * 2**30), int(completion))
    return text, None if fits else context_fit.refusal(dims, shape, int(device * 2**30), int(completion))


def translate_plan(argv: Sequence[str]) -> str:
    """``hf-grpo plan --from FRAMEWORK KEY=VALUE ...``: the equivalent flags and their plan (raises ValueError)."""
    from ..config import ENV_OVERRIDES, env_override
    from .translate import FRAMEWORKS, flatten_config, merge_settings, parse_settings, render, translate

    parser = argparse.ArgumentParser(
        prog="hf-grpo plan --from",
        description="Translate another RL framework's batch settings into hf-grpo flags and print their plan.",
        allow_abbrev=False,  # --n_samples_per_prompt=8 is a setting, never an abbreviation of --num_...
    )
    parser.add_argument("--from", dest="framework", required=True, choices=list(FRAMEWORKS))
    parser.add_argument("--num_processes", type=int, default=None,
                        help="data-parallel processes (default: the framework's GPU keys, else 1)")
    parser.add_argument("--num_generations", type=int, default=None, help="trlx only: completions per prompt")
    parser.add_argument("--config", default=None,
                        help="the framework's whole YAML config (nested keys read as dotted paths); KEY=VALUE "
                        "settings given too win over it; keys that are not batch settings are listed and ignored")
    parser.add_argument("settings", nargs="*", metavar="KEY=VALUE",
                        help="the framework's own keys and values; its own command line (--key value, --key=value, "
                        "a bare --switch) is read too")
    # OpenRLHF's own command line (--train_batch_size 256, --train_batch_size=256, a bare --flash_attn): settings too
    own_flags = ("--from", "--num_processes", "--num_generations", "--config", "--help", "-h")
    args = parser.parse_intermixed_args(framework_flags_as_settings(argv, own_flags))
    settings = parse_settings(args.settings)
    if args.config:
        loaded = load_yaml(args.config, f"the whole {args.framework} config")
        if not isinstance(loaded, dict):
            raise ValueError(f"{args.config} must hold a mapping (the framework's config), got {type(loaded).__name__}")
        settings = merge_settings(args.framework, flatten_config(loaded), settings)
    translation = translate(args.framework, settings, args.num_processes, args.num_generations)
    text = render(translation)
    for variable, name in ENV_OVERRIDES.items():  # the plan above is the flags'; at launch these win
        if env_override(variable) is not None:
            text += f"\nnote: {variable}={os.environ[variable]} is set: at launch it overrides {name}"
    return text


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: hf-grpo plan [--config FILE.yaml] [--num_processes N] [--<batch field> VALUE ...]")
        print("                    [--model_config CONFIG.json|SHAPE --device_memory_gib GIB ...]")
        print("       hf-grpo plan --from {skyrl,verl,openrlhf,trlx,d1} [--num_processes N] KEY=VALUE ...")
        print("  plan   print the batch plan of a config and check it against the batch-size contract;")
        print("         with --model_config, the longest completion its sizes fit on the device;")
        print("         with --from, first translate another framework's batch settings into hf-grpo flags")
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command != "plan":
        print(f"hf-grpo: unknown command {command!r}; the commands are: plan", file=sys.stderr)
        return 2
    try:
        translating = any(a == "--from" or a.startswith("--from=") for a in rest)
        plan, refusal = (translate_plan(rest), None) if translating else plan_text(rest)
    except (ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(plan)
    if refusal is not None:  # the plan is valid, but the trainer would refuse it at train begin
        print(f"error: {refusal}", file=sys.stderr)
        return 1
    return 0

