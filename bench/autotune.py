"""'auto' batch sizes and OOM back-off on a GPU under a memory cap: throughput, peak memory, survival.

Each scenario runs ``hf_grpo.GRPOTrainer`` for ``--max_steps`` optimizer steps on a random-init
Qwen2-0.5B-shaped model (``hf_grpo.recipe_support.tiny.SHAPES["0.5b"]``, bf16, built from a config: no download) with
random prompts of ``--min_prompt``..``--max_prompt`` tokens and a random reward, in its own process
(so peak memory does not mix), under ``torch.cuda.set_per_process_memory_fraction(--memory_fraction)``
(default 0.4 of the card). A random-init model almost never samples EOS, so every completion runs to
``--max_completion_length``: the longest lengths, the case the sizes must survive.

Scenarios (``--scenario``; ``all`` runs every one, each in a subprocess):

* ``default``: per_device_train_batch_size=8, steps_per_generation = gradient_accumulation_steps = 4,
  the whole rollout (32) per generation chunk, tensor_batch_size=1024.
* ``auto``: the three sizes "auto" (probed at train start under ``auto_memory_fraction`` of the cap;
  the global batch per optimizer step stays 8 x 4 = 32 completions).
* ``hand``: each ``P:g:t`` of ``--hand`` (P with gradient_accumulation_steps = 32 / P, so the same 32
  completions per step).
* ``oom``: the default sizes, but during rollouts 2 and 3 a hog tensor leaves only ``--hog_free_mib``
  MiB of the cap free, so generation runs out of memory; the back-off halves the chunk on the spot and
  the run goes on (the record says how often and to what size). On CPU (``--tiny``) the out-of-memory
  is injected into ``model.generate`` instead.
* ``oom_train``: the default sizes, but the micro-batches of optimizer step 2 run their forward and
  backward next to a hog that leaves free the gradient buffers' bytes plus ``--train_free_share`` (0.75)
  of what step 1's first forward and backward took beyond them, so the training step runs out of memory
  while a smaller micro-batch can still fit (the gradients are needed whatever the micro-batch size: a
  hog leaving less than them could be survived by no back-off). Gradient checkpointing is off in this
  scenario, so that the activations, which halve with the micro-batch, are most of that memory; in a
  one-process run the micro-batch is run again in token-budget passes of half its size
  (``max_tokens_per_micro_batch``, kept for the rest of the run). On CPU (``--tiny``) the
  out-of-memory is raised once from a gradient hook, half-way through a backward.

One JSON line per run on stdout (``RESULT {...}``; also appended to ``--out``): steps done, train
wall time (probing included, and ``probe_s`` alone), step times, generated tokens per second,
completions per second, peak allocated/reserved memory after the probe, chosen sizes, back-offs.

On the GPU machine, from the repository root:

    python bench/autotune.py --scenario all --out bench/results/raw/autotune.jsonl

CPU smoke test (tiny model, a few steps, every scenario):

    python bench/autotune.py --tiny --scenario all
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/: provenance.py
from provenance import with_provenance  # noqa: E402
import torch
from transformers import TrainerCallback

SCENARIOS = ("default", "auto", "hand", "oom", "oom_train")
_PEAK_BEFORE_RESET = [0]  # oom_train resets the peak to measure step 1's training; the run's peak is kept here


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenario", choices=(*SCENARIOS, "all"), default="all")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke test: tiny model, short lengths, 2 steps")
    parser.add_argument("--memory_fraction", type=float, default=0.4, help="per-process cap on the GPU")
    parser.add_argument("--auto_memory_fraction", type=float, default=0.9, help="share of the cap a probe may use")
    parser.add_argument("--hand", default="4:8:512,16:16:2048,32:32:4096",
                        help="comma-separated P:g:t hand-tuned settings (P divides 32)")
    parser.add_argument("--hand_one", default=None, help=argparse.SUPPRESS)  # one P:g:t, set by the driver
    parser.add_argument("--backend", default="auto", help="generation_backend")
    parser.add_argument("--max_steps", type=int, default=4)
    parser.add_argument("--max_completion_length", type=int, default=256)
    parser.add_argument("--min_prompt", type=int, default=32)
    parser.add_argument("--max_prompt", type=int, default=384)
    parser.add_argument("--num_generations", type=int, default=8)
    parser.add_argument("--hog_free_mib", type=int, default=160, help="oom: MiB of the cap left free by the hog")
    parser.add_argument("--train_free_share", type=float, default=0.75,
                        help="oom_train: share of step 1's training memory beyond the gradients left free by the hog")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="append each JSON record to this file")
    args = parser.parse_args(argv)
    if args.tiny:
        args.max_completion_length, args.min_prompt, args.max_prompt = 16, 4, 12
        args.max_steps = min(args.max_steps, 2)
        args.hand = "2:4:64"
    args.device = "cpu" if args.tiny else "cuda"
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device: use --tiny for the CPU smoke test")
    return args


# ---- one run ---------------------------------------------------------------------------------------
class StepClock(TrainerCallback):
    """Step wall times; peak memory counted from train begin (after the "auto" probe)."""

    def __init__(self, device):
        self.device, self.times, self._start = device, [], None

    def _sync(self):
        if self.device == "cuda":
            torch.cuda.synchronize()

    def on_train_begin(self, args, state, control, **kwargs):
        if self.device == "cuda":
            torch.cuda.reset_peak_memory_stats()

    def on_step_begin(self, args, state, control, **kwargs):
        self._sync()
        self._start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self._sync()
        self.times.append(time.perf_counter() - self._start)


def build(args):
    """Model, tokenizer and a dataset of random-id prompts."""
    from datasets import Dataset

    from hf_grpo.recipe_support.tiny import build_char_tokenizer, build_tiny_model

    if args.tiny:
        tokenizer, shape, dtype = build_char_tokenizer(), "tiny", torch.float32
    else:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from rollout import build_tokenizer  # bench/rollout.py: token "t<i>" is id i

        tokenizer, shape, dtype = build_tokenizer(), "0.5b", torch.bfloat16
    with torch.device(args.device):
        model = build_tiny_model(tokenizer, shape=shape, seed=args.seed, dtype=dtype)
    rng = random.Random(args.seed)
    sep = "" if args.tiny else " "
    ids = lambda n: tokenizer.convert_ids_to_tokens([rng.randrange(2, len(tokenizer)) for _ in range(n)])
    prompts = [sep.join(ids(rng.randint(args.min_prompt, args.max_prompt))) for _ in range(512)]
    return model, tokenizer, Dataset.from_dict({"prompt": prompts})


def sizes_for(args, scenario):
    if scenario == "auto":
        return dict(per_device_train_batch_size="auto", per_device_generation_batch_size="auto",
                    tensor_batch_size="auto", gradient_accumulation_steps=4, steps_per_generation=4)
    if scenario == "hand":
        P, g, t = (int(v) for v in args.hand_one.split(":"))
        steps = 32 // P if not args.tiny else 8 // P
        return dict(per_device_train_batch_size=P, per_device_generation_batch_size=g, tensor_batch_size=t,
                    gradient_accumulation_steps=steps, steps_per_generation=steps)
    P = 8 if not args.tiny else 4
    return dict(per_device_train_batch_size=P, gradient_accumulation_steps=4 if not args.tiny else 2,
                steps_per_generation=4 if not args.tiny else 2, tensor_batch_size=1024 if not args.tiny else 64)


def allocate_hog(args, free_bytes: float):
    """A tensor filling the per-process cap but ``free_bytes`` (None when nothing is left to fill).

    The cap counts reserved memory; the size steps down 32 MiB at a time so that what is left stays near
    ``free_bytes`` (a 5% step once left a whole GiB, and nothing ran out of memory).
    """
    torch.cuda.empty_cache()
    cap = torch.cuda.get_device_properties(0).total_memory * args.memory_fraction
    size = int(cap - torch.cuda.memory_reserved() - free_bytes)
    while size > 0:
        try:
            return torch.empty(size, dtype=torch.uint8, device="cuda")
        except torch.OutOfMemoryError:
            size -= 32 * 2**20
    return None


def hog_rollouts(trainer, args, rollouts=(2, 3)):
    """oom: rollouts 2 and 3 run next to a hog tensor that leaves ``hog_free_mib`` of the cap (GPU), or
    with ``model.generate`` failing above 2 sequences (CPU)."""
    generate, count = trainer._generate_single_turn, [0]
    model_generate = trainer.model.generate

    def failing_generate(*a, **k):  # CPU: the allocator cannot be filled, so the error is injected
        if k["input_ids"].size(0) > 2:
            raise torch.OutOfMemoryError("injected by bench/autotune.py")
        return model_generate(*a, **k)

    def hogged(*a, **k):
        count[0] += 1
        hog = None
        if count[0] in rollouts:
            if args.device == "cuda":
                hog = allocate_hog(args, args.hog_free_mib * 2**20)
            else:
                trainer.model.generate = failing_generate
        try:
            return generate(*a, **k)
        finally:
            del hog
            trainer.model.generate = model_generate

    trainer._generate_single_turn = hogged


def hog_training(trainer, args, steps=(2,)):
    """oom_train: step 1's forward/backward is measured; those of ``steps`` run next to a hog leaving the
    gradient buffers plus ``train_free_share`` of the rest of it."""
    compute = trainer.compute_loss
    measured = {"train_bytes": 0}
    if args.device == "cpu":  # the allocator cannot be filled: raise once, half-way through step 2's first backward
        fired = []

        def hook(grad):
            if trainer.state.global_step + 1 in steps and not fired:
                fired.append(True)
                raise torch.OutOfMemoryError("injected by bench/autotune.py")
            return grad

        trainer.model.model.layers[0].self_attn.q_proj.weight.register_hook(hook)
        return

    def hogged(model, inputs, *a, **k):
        step, hog = trainer.state.global_step + 1, None
        if step == 1:
            torch.cuda.synchronize()
            _PEAK_BEFORE_RESET[0] = max(_PEAK_BEFORE_RESET[0], torch.cuda.max_memory_allocated())
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            try:
                return compute(model, inputs, *a, **k)
            finally:
                torch.cuda.synchronize()
                measured["train_bytes"] = max(measured["train_bytes"], torch.cuda.max_memory_allocated() - base)
        if step in steps and measured["train_bytes"]:
            grads = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
            measured["grad_bytes"] = grads
            beyond = max(measured["train_bytes"] - grads, 0)
            hog = allocate_hog(args, grads + args.train_free_share * beyond)
        try:
            return compute(model, inputs, *a, **k)
        finally:
            del hog

    trainer.compute_loss = hogged
    trainer._bench_train_bytes = measured


def run_one(args, scenario) -> dict:
    import hf_grpo.memory.autosize
    from hf_grpo import GRPOConfig, GRPOTrainer

    if args.device == "cuda":
        torch.cuda.set_per_process_memory_fraction(args.memory_fraction)
    model, tokenizer, dataset = build(args)
    workdir = tempfile.mkdtemp(prefix="autotune_")
    config = GRPOConfig(
        output_dir=os.path.join(workdir, "out"), num_generations=args.num_generations if not args.tiny else 4,
        max_completion_length=args.max_completion_length, beta=0.0, learning_rate=1e-6, max_steps=args.max_steps,
        logging_steps=1, save_strategy="no", report_to=[], bf16=not args.tiny, use_cpu=args.tiny,
        disable_tqdm=True, seed=args.seed, generation_backend=args.backend,
        auto_memory_fraction=args.auto_memory_fraction, **sizes_for(args, scenario),
        # oom_train: without checkpointing the activations, which a smaller micro-batch shrinks, outweigh
        # what it does not (the gradients, one LM-head chunk), so the hog's OOM is one a back-off can survive.
        activation_checkpointing=scenario != "oom_train",
    )
    clock = StepClock(args.device)
    trainer = GRPOTrainer(model=model, reward_funcs=lambda completions, **k: [random.random() for _ in completions],
                          args=config, train_dataset=dataset, processing_class=tokenizer, callbacks=[clock])
    if scenario == "oom":
        hog_rollouts(trainer, args)
    if scenario == "oom_train":
        hog_training(trainer, args)
    probe = {"s": 0.0, "chosen": None}
    resolve = hf_grpo.memory.autosize.resolve_auto_sizes

    def timed_resolve(*a, **k):
        t0 = time.perf_counter()
        probe["chosen"] = resolve(*a, **k)
        probe["s"] = time.perf_counter() - t0
        return probe["chosen"]

    hf_grpo.memory.autosize.resolve_auto_sizes = timed_resolve
    t0 = time.perf_counter()
    trainer.train()
    train_s = time.perf_counter() - t0
    stats = trainer.get_performance_stats()
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    completions = trainer.state.global_step * trainer.args.per_device_train_batch_size * \
        trainer.args.gradient_accumulation_steps
    steady = clock.times[1:] or clock.times
    record = dict(
        bench="autotune", scenario=scenario, hand=args.hand_one if scenario == "hand" else None,
        device=torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        memory_fraction=args.memory_fraction if args.device == "cuda" else None,
        sizes=trainer.sizes.values(),  # the run's sizes as they ended (after "auto" and any back-off)
        completions_per_step=trainer.args.per_device_train_batch_size * trainer.args.gradient_accumulation_steps,
        steps_done=trainer.state.global_step, train_s=round(train_s, 2), probe_s=round(probe["s"], 2),
        step_s=[round(t, 3) for t in clock.times],
        completions_per_s_after_first=round(len(steady) * completions / trainer.state.global_step / sum(steady), 3),
        rollout_tokens_per_s=round(stats["rollout_tokens_per_s"], 1),
        train_tokens_per_s=round(stats["train_tokens_per_s"], 1),
        oom_backoffs=sum(entry.get("perf/oom_backoffs", 0) for entry in logged),
        generation_backend=getattr(trainer.decisions.backend, "name", None),
        train_micro_batches_rerun=getattr(trainer._train_backoff, "replays", None),
    )
    if scenario == "oom_train" and args.device == "cuda":
        record["step1_train_gib"] = round(trainer._bench_train_bytes["train_bytes"] / 2**30, 3)
        record["grad_gib"] = round(trainer._bench_train_bytes.get("grad_bytes", 0) / 2**30, 3)
        record["train_free_share"] = args.train_free_share
    if args.device == "cuda":
        peak = max(torch.cuda.max_memory_allocated(), _PEAK_BEFORE_RESET[0])
        record.update(peak_allocated_gib=round(peak / 2**30, 3),
                      peak_reserved_gib=round(torch.cuda.max_memory_reserved() / 2**30, 3),
                      cap_gib=round(torch.cuda.get_device_properties(0).total_memory * args.memory_fraction / 2**30, 2))
    return record


def emit(record, out):
    line = json.dumps(with_provenance(record))
    print("RESULT " + line, flush=True)
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "a") as handle:
            handle.write(line + "\n")


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.scenario != "all":
        try:
            record = run_one(args, args.scenario)
        except Exception as err:
            record = dict(bench="autotune", scenario=args.scenario, hand=args.hand_one, failed=f"{type(err).__name__}: "
                          f"{str(err).splitlines()[0][:300] if str(err) else ''}")
        emit(record, args.out)
        return 0 if "failed" not in record else 1
    # the driver: every scenario (each hand setting too) in its own process, so peaks do not mix
    base = [a for a in argv if not a.startswith("--scenario=")]
    if "--scenario" in base:
        index = base.index("--scenario")
        base = base[:index] + base[index + 2:]
    runs = [["--scenario", s] for s in SCENARIOS if s != "hand"]
    runs += [["--scenario", "hand", "--hand_one", h] for h in args.hand.split(",")]
    failed = 0
    for extra in runs:
        failed += subprocess.call([sys.executable, os.path.abspath(__file__), *base, *extra]) != 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
