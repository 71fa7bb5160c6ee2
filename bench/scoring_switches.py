"""The host's time on TRL's switches around one rollout, transformers' and PEFT's own against the trainer's quick ones.

For each rollout TRL 1.16 turns activation checkpointing off and on around the generation and again around the
no-grad scoring, and scores a new LoRA adapter's reference with the adapters off (``trl.trainer.utils.use_adapter``:
PEFT's ``disable_adapter``). None of it runs on a GPU, which waits. This runs that sequence as TRL does on a model of
a real model's module structure (Qwen2-shaped, ``--layers`` decoder layers, every linear layer with LoRA, or none:
``--lora_r 0``) at tiny widths (the walks' cost is in the modules, not their sizes), first with the libraries' own
switches, then inside ``hf_grpo.training.scoring_switches.QuickSwitches.installed`` (the trainer's), and prints one
JSON row of each's median milliseconds a rollout. A CPU measures this as well as a GPU host would: no kernel runs.

    python bench/scoring_switches.py --layers 28 --out bench/results/scoring_switches_cpu.jsonl
"""

from __future__ import annotations

import argparse
import contextlib
import pathlib
import platform
import statistics
import sys
import time
import warnings

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from provenance import emit, with_provenance  # noqa: E402


def build(layers: int, lora_r: int):
    from hf_grpo.recipe_support.tiny import build_char_tokenizer, build_tiny_model

    model = build_tiny_model(build_char_tokenizer(), num_hidden_layers=layers)
    if lora_r:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=lora_r, lora_alpha=2 * lora_r, target_modules="all-linear"))
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    return model.train()


def rollout_switches(model, lora: bool) -> None:
    """What TRL 1.16 switches for one rollout, in its order (the model's calls left out)."""
    from trl.models.utils import disable_gradient_checkpointing
    from trl.trainer.utils import use_adapter

    kwargs = {"use_reentrant": False}
    with disable_gradient_checkpointing(model, kwargs):  # unwrap_model_for_generation's: the same two calls
        pass
    with disable_gradient_checkpointing(model, kwargs), (use_adapter(model, None) if lora else contextlib.nullcontext()):
        pass  # the reference pass


def timed(model, lora: bool, quick: bool, repeats: int) -> list[float]:
    from hf_grpo.training.scoring_switches import QuickSwitches

    switches = QuickSwitches(model, model) if quick else None
    times = []
    for _ in range(repeats + 2):  # two warm-ups
        with switches.installed() if quick else contextlib.nullcontext():
            start = time.perf_counter()
            rollout_switches(model, lora)
            times.append(1e3 * (time.perf_counter() - start))
    return times[2:]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=28, help="decoder layers (Qwen2.5-7B and -1.5B: 28)")
    parser.add_argument("--lora_r", type=int, default=16, help="LoRA rank on every linear layer; 0: a full fine-tune")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--out", default=None, help="append the JSON row to this file")
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore", FutureWarning)  # transformers' deprecated names, which TRL 1.16 calls
    model = build(args.layers, args.lora_r)
    row = {"bench": "scoring_switches", "layers": args.layers, "lora_r": args.lora_r,
           "modules": sum(1 for _ in model.modules()), "cpu": platform.processor() or platform.machine(),
           "peft": __import__("peft").__version__}
    for name, quick in (("own_ms", False), ("quick_ms", True), ("own_again_ms", False)):
        row[name] = round(statistics.median(timed(model, args.lora_r > 0, quick, args.repeats)), 3)
    row["saved_ms_a_rollout"] = round((row["own_ms"] + row["own_again_ms"]) / 2 - row["quick_ms"], 3)
    emit(with_provenance(row), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
