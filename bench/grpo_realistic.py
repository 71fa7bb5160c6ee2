"""A whole GRPO run as real training runs it: hf_grpo.GRPOTrainer against trl.GRPOTrainer, same config.

What it measures, for ONE implementation per process (run them one after another, in separate
processes, so that their peak memory does not mix):

* every optimizer step's wall time, the first included (warm-up, cuDNN plans, torch.compile and
  CUDA-graph capture are part of the run), from a ``TrainerCallback`` (``on_step_begin`` /
  ``on_step_end``, ``torch.cuda.synchronize`` on both sides);
* every rollout's generation time (``trainer._generate_single_turn`` wrapped on the instance), with
  its completion count, generated tokens and longest completion;
* the wall time of the whole ``trainer.train()``;
* GPU memory: the weights held right before training (policy + reference model), then
  ``torch.cuda.max_memory_allocated()`` / ``max_memory_reserved()`` over training (peak statistics
  are reset after the models are loaded), the allocated peak also split into the highest peak inside
  a generation and outside one (scoring, training);
* the completion lengths TRL logs each step (``completions/mean_length``, min, max,
  ``clipped_ratio``, from ``trainer.state.log_history``), generated tokens, GPU name, versions;
* for ``--impl hf_grpo`` also ``trainer.get_performance_stats()`` (less its batch plan).

The run is set up like a real one:

* a random-init Qwen2-shaped model (``hf_grpo.recipe_support.tiny.SHAPES``: ``0.5b`` default, ``1.5b``; vocabulary
  151936; bf16) with the word-level tokenizer of ``bench/rollout.py`` (token ``t<i>`` is id ``i``),
  SAVED with ``save_pretrained`` and loaded back from that directory, so that TRL builds the
  reference model (``beta=0.04``) from the policy's path as it does for a hub checkpoint;
* prompts of varied length, each drawn uniformly from ``[--min_prompt, --max_prompt]`` tokens
  (default 32..384) of random ids, seeded; a random but seeded reward;
* completions NOT forced to full length (no ``min_new_tokens``, no ``ignore_eos``). A random-init
  model almost never samples EOS (1 in 151936), and scaling its EOS row alone would give every
  sequence its own random EOS rate (the final hidden states share no direction across sequences).
  So before saving, one hidden channel is made constant (that column of the input embedding set to
  16 for every token; the final norm's weight of the channel scaled down) and the EOS row of the
  tied embedding is set to ``alpha`` on that channel alone, ``alpha`` bisected so that EOS gets
  ``--eos_prob`` (default 1%) of the probability at every completion position (``plant_eos``; the
  other tokens keep their near-uniform distribution). Completion lengths are then geometric, capped:
  mean ~92 of 256 tokens at 1%, ~7.6% of completions clipped, so most rollouts still have one that
  runs to the cap, as in early real training; ``--eos_prob 0.03`` gives a mean of ~33 and no
  clipping. The calibration is recorded (``eos``).
* defaults, 32 completions per optimizer step on one GPU: per_device_train_batch_size=8,
  steps_per_generation=4, gradient_accumulation_steps=4, num_generations=8,
  max_completion_length=256, beta=0.04, learning_rate=1e-6, temperature=1.0, max_steps=10,
  logging_steps=1, bf16, activation checkpointing as TRL's default (on; ``--checkpointing``).

``--impl trl`` runs ``trl.GRPOTrainer`` / ``trl.GRPOConfig`` (TRL 1.16's default generation:
one ``model.generate`` call for the whole rollout). ``--impl hf_grpo`` runs ``hf_grpo.GRPOTrainer`` /
``hf_grpo.GRPOConfig`` with the same settings plus ``--backend`` (``generation_backend``),
``--tensor_batch_size`` (default 1024) and ``--per_device_generation_batch_size`` (default: the
whole rollout). ``--max_seconds`` stops training after the step that crosses it (the record says
``stopped_early``), so a run under a hard time limit still reports.

Under ``accelerate launch`` (``bench/run_launch_configs.sh``: ZeRO-2, ZeRO-3, any config, TRL alike) every
process builds the same checkpoint in a directory of its own and trains on its own GPU (``LOCAL_RANK``); rank 0
writes the run's one record, its own figures at the top level, every rank's steps, phases, peaks and stats under
``per_rank``, and the launch under ``launch`` (world size, DeepSpeed's stage, the config ``--launch_config``
names). ``--max_seconds`` stops every rank at the same step. Under DeepSpeed the optimizer step runs inside
``accelerator.backward``, so ``--phases`` charges it to ``backward`` for both trainers.

Prints one line ``RESULT {json}`` and appends the JSON to ``--out`` if given. On the GPU machine,
from the repository root (``bench/run_realistic.sh`` runs all of these):

    python3 bench/grpo_realistic.py --impl trl --out bench/results/raw/grpo_realistic.jsonl
    python3 bench/grpo_realistic.py --impl hf_grpo --backend hf --out bench/results/raw/grpo_realistic.jsonl
    python3 bench/grpo_realistic.py --impl hf_grpo --backend cuda_graph --out bench/results/raw/grpo_realistic.jsonl
    python3 bench/grpo_realistic.py --impl hf_grpo --backend hf --tensor_batch_size 256 \\
        --per_device_generation_batch_size 8 --out bench/results/raw/grpo_realistic.jsonl

CPU smoke test (tiny model, character tokenizer, fp32, no CUDA timing calls):

    python bench/grpo_realistic.py --device cpu --shape tiny --max_steps 2 --impl trl \\
        --min_prompt 8 --max_prompt 24 --max_completion_length 32
    python bench/grpo_realistic.py --device cpu --shape tiny --max_steps 2 --impl hf_grpo --backend hf \\
        --min_prompt 8 --max_prompt 24 --max_completion_length 32
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # bench/rollout.py
sys.path.insert(0, os.path.dirname(HERE))  # the repository root: hf_grpo

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/: provenance.py
from provenance import with_provenance  # noqa: E402
import torch  # noqa: E402
from transformers import TrainerCallback  # noqa: E402


def cuda_sync(device: str):
    if device == "cuda":
        torch.cuda.synchronize()


def launch_info() -> dict:
    """This process's place in an ``accelerate launch`` (one process without it): rank, world size, and what
    the launch config set up, as accelerate passes it to the processes."""
    env = os.environ
    return dict(rank=int(env.get("RANK", 0)), local_rank=int(env.get("LOCAL_RANK", 0)),
                world_size=int(env.get("WORLD_SIZE", 1)), deepspeed=env.get("ACCELERATE_USE_DEEPSPEED") == "true",
                zero_stage=int(env["ACCELERATE_DEEPSPEED_ZERO_STAGE"]) if env.get("ACCELERATE_DEEPSPEED_ZERO_STAGE")
                else None, fsdp=env.get("ACCELERATE_USE_FSDP") == "true")


def any_rank(flag: bool) -> bool:
    """``flag`` on any rank (every rank must stop at the same step, or the others wait in a collective)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return flag
    device = "cuda" if torch.distributed.get_backend() == "nccl" else "cpu"
    value = torch.tensor([float(flag)], device=device)
    torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX)
    return bool(value.item())


def gather_ranks(part: dict) -> list[dict]:
    """Every rank's ``part``, in rank order (on every rank); ``[part]`` in one process."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return [part]
    parts = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(parts, part)
    return parts


def progress(line: str) -> None:
    """A progress line on rank 0's output: ``bench/run_launch_configs.sh`` reads them from a run it had to stop."""
    if launch_info()["rank"] == 0:
        print(line, flush=True)


class StepTimer(TrainerCallback):
    """Wall time of every optimizer step; optionally stops training once ``max_seconds`` have passed (on every
    rank at the same step)."""

    def __init__(self, device: str, max_seconds: float | None = None):
        self.device, self.max_seconds = device, max_seconds
        self.times: list[float] = []
        self.stopped_early = False
        self.train_start = None

    def on_train_begin(self, args, state, control, **kwargs):
        self.train_start = time.perf_counter()
        progress("TRAIN_BEGIN")

    def on_step_begin(self, args, state, control, **kwargs):
        cuda_sync(self.device)
        self.start = time.perf_counter()
        # the wall clock: a run stopped mid-step still shows that step lasted at least until its limit
        progress(f"STEP_BEGIN {state.global_step + 1} {time.time():.1f}")

    def on_step_end(self, args, state, control, **kwargs):
        cuda_sync(self.device)
        now = time.perf_counter()
        self.times.append(now - self.start)
        progress(f"STEP {state.global_step} {self.times[-1]:.3f}")  # a run killed at its limit still says how far
        if (self.max_seconds is not None and state.global_step < state.max_steps
                and any_rank(now - self.train_start > self.max_seconds)):
            self.stopped_early = True
            control.should_training_stop = True


class StepProfiler(TrainerCallback):
    """``torch.profiler`` over one optimizer step (``--profile_step``): a table of the ops that took the most
    device and host time, and the Chrome trace (gzipped), written to ``--profile_dir``."""

    def __init__(self, step: int, directory: str, label: str, after_generation: bool = False,
                 with_stack: bool = False):
        self.step, self.directory, self.label = step, directory, label
        self.after_generation, self.with_stack = after_generation, with_stack
        self.armed = False
        self.profiler = None

    def watch_generation(self, trainer) -> None:
        """Start the profile when the step's rollout returns (``--profile_after_generation``): a long rollout's
        million replayed kernels would swamp the trace of the training half."""
        generate = trainer._generate_single_turn

        def generate_then_profile(*args, **kwargs):
            result = generate(*args, **kwargs)
            if self.armed and self.profiler is None:
                cuda_sync("cuda" if torch.cuda.is_available() else "cpu")
                self._start()
            return result

        trainer._generate_single_turn = generate_then_profile

    def _start(self) -> None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        # with_stack: Python's functions in the trace too, so a gap between kernels names the code the host ran
        self.profiler = torch.profiler.profile(activities=activities, with_stack=self.with_stack)
        self.profiler.__enter__()

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step + 1 == self.step:
            self.armed = True
            if not self.after_generation:
                self._start()

    def on_step_end(self, args, state, control, **kwargs):
        if self.profiler is None:
            return
        self.armed = False
        cuda_sync("cuda" if torch.cuda.is_available() else "cpu")
        self.profiler.__exit__(None, None, None)
        os.makedirs(self.directory, exist_ok=True)
        label = re.sub(r"[^A-Za-z0-9_.-]+", "_", self.label)  # a launch label ("zero2 x1, hf_grpo") as a file name
        stem = os.path.join(self.directory, f"profile_{label}_step{self.step}")
        averages = self.profiler.key_averages()
        with open(stem + ".txt", "w") as handle:
            for key in ("self_cuda_time_total", "self_cpu_time_total", "cpu_time_total"):
                handle.write(f"== sorted by {key}\n{averages.table(sort_by=key, row_limit=45)}\n")
        self.profiler.export_chrome_trace(stem + ".json")
        subprocess.run(["gzip", "-f", stem + ".json"], check=False)
        self.profiler = None


# ---- the model, its EOS row and the prompts ------------------------------------------------------
@torch.no_grad()
def plant_eos(model, eos_id: int, target: float, *, device: str, seq_len: int, skip: int, seed: int,
              channel: int = 0, constant: float = 16.0) -> dict:
    """Give EOS the probability ``target`` at every completion position; returns the calibration.

    Scaling the EOS row alone does not work: the final hidden states of a random-init Qwen2 carry a
    large direction of their own per sequence (the running average of its tokens' values; measured on
    the 0.5b shape: the per-sequence mean has norm ~24 of ~30, and the means of two sequences have cosine
    ~0), so any fixed EOS row gives each sequence its own random EOS logit: some would stop at once and
    many never. Instead one hidden channel is made constant:

    1. column ``channel`` of the input embedding is set to ``constant`` for every token. Through the
       residual stream the final hidden state's ``channel`` is then the same at every position of every
       sequence (0.5b, constant 16: 5.89 +- 0.02). Where the embedding is tied this also adds
       ``constant * h[channel]``, the same amount, to every logit, which softmax ignores;
    2. the final norm's weight of that channel is scaled so that this shared logit offset is ~1
       (small: bf16 logits keep their resolution);
    3. the EOS row of the output embedding becomes ``alpha`` on that channel and zero elsewhere, so
       EOS gets the nearly constant logit ``alpha * h[channel]``; ``alpha`` is bisected on the mean over
       positions of softmax(...)[EOS], computed exactly from the other logits' logsumexp.

    The other tokens keep their (near uniform) distribution. EOS never appears in a prompt; as the
    last completion token it is read only by positions whose loss is masked. The result is checked on
    fresh random sequences through the model's own norm and lm_head in its dtype.
    """
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(seed)
    embed_in = model.get_input_embeddings().weight
    lm_head = model.get_output_embeddings()
    final_norm = model.model.norm.weight

    def hidden(n):
        ids = torch.randint(2, vocab, (n, seq_len), generator=gen).to(device)
        h = model.model(input_ids=ids).last_hidden_state[:, skip:]
        return h.reshape(-1, h.shape[-1])

    final_norm[channel] = 1.0
    while True:  # a constant large enough that the channel no longer depends on the tokens
        embed_in[:, channel] = constant
        h_c = hidden(4)[:, channel].float()
        if h_c.mean().abs() > 50 * h_c.std() or constant >= 1024:
            break
        constant *= 2
    final_norm[channel] = 1.0 / (constant * h_c.mean().item())  # shared logit offset ~1 where tied
    h = hidden(4)
    proj = h[:, channel].float()
    rest = []  # logsumexp of every logit but EOS's, per position
    for rows in h.split(512):
        logits = lm_head(rows).float()
        logits[:, eos_id] = -math.inf
        rest.append(torch.logsumexp(logits, dim=-1))
    rest = torch.cat(rest)

    def mean_p(alpha):
        return torch.sigmoid(alpha * proj - rest).mean().item()

    lo, hi = -1.0, 1.0  # mean_p grows with alpha; a small vocabulary may need alpha < 0
    while mean_p(hi) < target and hi < 1e6:
        hi *= 2
    while mean_p(lo) > target and lo > -1e6:
        lo *= 2
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if mean_p(mid) < target else (lo, mid)
    alpha = (lo + hi) / 2
    lm_head.weight[eos_id] = 0.0
    lm_head.weight[eos_id, channel] = alpha

    h = hidden(2)  # fresh sequences
    p = torch.cat([torch.softmax(lm_head(rows).float(), dim=-1)[:, eos_id] for rows in h.split(512)])
    quartiles = torch.quantile(p, torch.tensor([0.05, 0.5, 0.95], device=p.device)).tolist()
    return dict(
        method="constant channel", target=target, channel=channel, constant=constant,
        final_norm_weight=round(final_norm[channel].item(), 6), alpha=round(alpha, 3),
        channel_value_mean=round(proj.mean().item(), 5), channel_value_std=round(proj.std().item(), 6),
        measured_mean_p=round(p.mean().item(), 5), measured_p_5_50_95=[round(q, 5) for q in quartiles],
    )


def expected_mean_length(p: float, cap: int) -> float:
    """Mean length of a completion that stops with probability p per token (EOS counted), capped at ``cap``."""
    return cap if p <= 0 else (1 - (1 - p) ** cap) / p


def build_checkpoint(args, directory: str) -> tuple[dict, object]:
    """Random-init model + tokenizer with a planted EOS, saved to ``directory``; returns (calibration, tokenizer)."""
    from hf_grpo.recipe_support.tiny import build_char_tokenizer, build_tiny_model

    if args.shape == "tiny":
        tokenizer = build_char_tokenizer()
    else:
        from rollout import build_tokenizer  # bench/rollout.py: token "t<i>" is id i

        tokenizer = build_tokenizer()
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    with torch.device(args.device):  # random init straight on the device: seconds instead of a minute
        model = build_tiny_model(tokenizer, shape=args.shape, seed=args.seed, dtype=dtype)
    model.eval()
    calibration = {"target": 0.0}
    if args.eos_prob > 0:
        calibration = plant_eos(
            model, tokenizer.eos_token_id, args.eos_prob, device=args.device,
            seq_len=args.max_prompt + args.max_completion_length, skip=args.min_prompt, seed=args.seed + 1,
        )
    calibration["expected_mean_len"] = round(expected_mean_length(args.eos_prob, args.max_completion_length), 1)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    del model
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return calibration, tokenizer


def make_prompts(tokenizer, args) -> list[str]:
    """Prompts of random ids, each of a length drawn uniformly from [min_prompt, max_prompt] tokens."""
    rng = random.Random(args.seed)
    first = 2  # ids 0 and 1 are <pad> and <eos> in both tokenizers
    sep = " " if args.shape != "tiny" else ""  # word-level tokens are space separated; characters are not
    vocab = len(tokenizer)
    prompts = []
    for _ in range(args.num_prompts):
        n = rng.randint(args.min_prompt, args.max_prompt)
        prompts.append(sep.join(tokenizer.convert_ids_to_tokens([rng.randrange(first, vocab) for _ in range(n)])))
    for text in prompts[:8]:  # the lengths must be what they were drawn as
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert args.min_prompt <= len(ids) <= args.max_prompt, (len(ids), text[:80])
    return prompts


# ---- the run -------------------------------------------------------------------------------------
def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--impl", choices=["trl", "hf_grpo"], required=True)
    parser.add_argument("--backend", default="auto", help="hf_grpo generation_backend: auto, hf, cuda_graph")
    parser.add_argument("--trl_continuous_batching", action="store_true",
                        help="--impl trl only: TRL's use_transformers_continuous_batching=True (its no-vLLM fast path)")
    parser.add_argument("--shape", choices=["0.5b", "1.5b", "7b", "tiny"], default="0.5b")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--per_device_train_batch_size", type=int, default=8)
    parser.add_argument("--steps_per_generation", type=int, default=4)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=4)
    parser.add_argument("--num_generations", type=int, default=8)
    parser.add_argument("--max_completion_length", type=int, default=256)
    parser.add_argument("--min_prompt", type=int, default=32)
    parser.add_argument("--max_prompt", type=int, default=384)
    parser.add_argument("--num_prompts", type=int, default=1024, help="dataset size (prompts)")
    parser.add_argument("--eos_prob", type=float, default=0.01,
                        help="EOS probability at an average position (0: leave the random-init model as it is)")
    parser.add_argument("--full_length", action="store_true",
                        help="every completion runs to --max_completion_length: EOS is blocked until then "
                        "(generation_kwargs min_new_tokens, honoured by TRL's generate and hf_grpo's decoder alike)")
    parser.add_argument("--beta", type=float, default=0.04)
    parser.add_argument("--learning_rate", type=float, default=1e-6)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--max_steps", type=int, default=10)
    parser.add_argument("--max_seconds", type=float, default=None,
                        help="stop training after the step that passes this many seconds of trainer.train()")
    parser.add_argument("--checkpointing", choices=["default", "on", "off"], default="default",
                        help="activation (gradient) checkpointing; default: TRL's default (on)")
    parser.add_argument("--tensor_batch_size", type=int, default=1024, help="hf_grpo only")
    parser.add_argument("--per_device_generation_batch_size", type=int, default=None, help="hf_grpo only")
    parser.add_argument("--cudnn_attention", choices=["default", "on", "off"], default="default",
                        help="cuDNN's SDPA kernel: each implementation's default (TRL: torch's, on; hf_grpo: off), "
                        "or on / off for both (for TRL through torch.backends.cuda.enable_cudnn_sdp)")
    parser.add_argument("--num_iterations", type=int, default=1,
                        help="passes over each rollout (2: every other optimizer step trains without generating)")
    parser.add_argument("--old_logprobs_source", choices=["default", "auto", "sampler", "recompute"],
                        default="default", help="hf_grpo only: which log-probs stand for the old policy's")
    parser.add_argument("--lora_r", type=int, default=0, help="LoRA rank (peft; 0: full fine-tuning)")
    parser.add_argument("--padding_free", choices=["default", "on", "off"], default="default",
                        help="hf_grpo only: score rows packed (on) or padded (off); default: the config's default")
    parser.add_argument("--lora_generation_mirror", choices=["default", "auto", "on", "off"], default="default",
                        help="hf_grpo only: decode LoRA rollouts from the weights with the adapters merged (default: the config's)")
    parser.add_argument("--zero3_generation_mirror", choices=["default", "auto", "on", "off"], default="default",
                        help="hf_grpo only: ZeRO-3's dense generation mirror (default: the config's)")
    parser.add_argument("--release_generation_memory", choices=["default", "on", "off"], default="default",
                        help="hf_grpo only: free the decoder's cache and graphs, and ZeRO-3's mirror, after each "
                        "rollout (default: the config's, on)")
    parser.add_argument("--dense_mirror_in_one_process", action="store_true",
                        help="hf_grpo only, a probe: under ZeRO-3 with one process decode from the dense copy that "
                        "several processes decode from (one process otherwise reads its whole partitions in place), "
                        "so that the mirror's memory can be measured on one GPU")
    parser.add_argument("--compile_training", choices=["default", "auto", "on", "cpp_wrapper", "off"], default="default",
                        help="hf_grpo only: compile the training forward's decoder layers (default: the config's)")
    parser.add_argument("--compile_generation", choices=["default", "auto", "on", "off"], default="default",
                        help="hf_grpo only: compile the cuda_graph backend's decode step (default: the config's)")
    parser.add_argument("--training_cuda_graphs", choices=["default", "auto", "on", "off"], default="default",
                        help="hf_grpo only: replay training micro-batches from CUDA graphs (default: the config's)")
    parser.add_argument("--lora_fused_forward", choices=["default", "on", "off"], default="default",
                        help="hf_grpo only: LoRA projections as base + addmm (on) or PEFT's forward (off)")
    parser.add_argument("--shape_reuse_capture_cost", type=float, default=None,
                        help="hf_grpo only: a capture's cost in replays of its micro-batch, up to which a new packed "
                        "shape replays captured larger ones (hf_grpo.training.shape_reuse; 0: none; default: the "
                        "module's)")
    parser.add_argument("--share_prompts", choices=["on", "off"], default="on",
                        help="hf_grpo only: packed rows of one prompt run its tokens once (off: every row whole)")
    parser.add_argument("--group_prompts", choices=["on", "off"], default="on",
                        help="hf_grpo only: a prompt's rows in the same micro-batches where the step stays the same "
                        "(hf_grpo.training.prompt_groups; off: TRL's shuffled rows)")
    parser.add_argument("--phases", action="store_true",
                        help="time each step's phases (bench/phase_timer.py; syncs the device at every boundary)")
    parser.add_argument("--true_on_policy", action="store_true",
                        help="hf_grpo only: the decoder and the trainer on the same batch-invariant kernels")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--label", default=None, help="free text kept in the record (e.g. 'cold compile cache')")
    parser.add_argument("--launch_config", default=None,
                        help="the accelerate config file this run was launched with, kept in the record (under "
                        "accelerate launch: bench/run_launch_configs.sh passes it)")
    parser.add_argument("--out", default=None, help="append the JSON record to this file")
    parser.add_argument("--profile_step", type=int, default=None,
                        help="profile this optimizer step (1-based) with torch.profiler: a table and a trace")
    parser.add_argument("--profile_after_generation", action="store_true",
                        help="with --profile_step: profile the step from the end of its rollout (the training half)")
    parser.add_argument("--profile_with_stack", action="store_true",
                        help="with --profile_step: Python's functions in the trace too (python_function events), so "
                        "bench/trace_gaps.py names the code the host ran in each gap (a larger trace, a slower host)")
    parser.add_argument("--profile_dir", default=os.environ.get("OUT", "bench/results/raw"),
                        help="where --profile_step writes (default $OUT)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda but CUDA is not available (use --device cpu --shape tiny for a smoke test)")
    args.bf16 = args.device == "cuda"
    if args.device == "cuda":  # under accelerate launch: this process's GPU, before anything is built on it
        torch.cuda.set_device(launch_info()["local_rank"])
    return args


def compile_report() -> dict:
    """What torch.compile did in this process: graphs, recompiles, cache hits and seconds by stage (the
    first step's cost, and whether a warm cache served it)."""
    from torch._dynamo.utils import compilation_time_metrics, counters

    wanted = {"stats": ("unique_graphs", "calls_captured"), "recompiles": None,
              "inductor": ("fxgraph_cache_hit", "fxgraph_cache_miss", "fxgraph_cache_bypass"),
              "aot_autograd": ("autograd_cache_hit", "autograd_cache_miss", "autograd_cache_bypass")}
    report = {}
    for group, keys in wanted.items():
        values = counters.get(group, {})
        report[group] = dict(values) if keys is None else {key: values.get(key, 0) for key in keys}
    report["seconds"] = {name: round(sum(times), 2) for name, times in compilation_time_metrics.items()
                         if sum(times) >= 0.05}
    return report


def main(argv=None) -> int:
    args = parse_args(argv)
    import datasets
    import transformers
    import trl
    from transformers import PreTrainedTokenizerFast, Qwen2ForCausalLM

    device = args.device
    workdir = tempfile.mkdtemp(prefix="grpo_realistic_")
    checkpoint = os.path.join(workdir, "model")
    start = time.perf_counter()
    calibration, _ = build_checkpoint(args, checkpoint)
    # Loaded back from the path, as a hub model would be: TRL builds the reference model from
    # model.config._name_or_path (this directory) with the policy's dtype.
    tokenizer = PreTrainedTokenizerFast.from_pretrained(checkpoint)
    model = Qwen2ForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16 if args.bf16 else torch.float32)
    build_s = time.perf_counter() - start

    from datasets import Dataset

    dataset = Dataset.from_dict({"prompt": make_prompts(tokenizer, args)})
    reward_rng = random.Random(args.seed + 2)

    def random_reward(completions, **kwargs):
        return [reward_rng.random() for _ in completions]

    if args.impl == "trl":
        from trl import GRPOConfig, GRPOTrainer

        from hf_grpo.distributed import before_deepspeed_starts

        # as hf_grpo's trainer does first: under DeepSpeed on a CPU (--tiny launches), DeepSpeed would build a
        # shared-memory communication op it never uses (minutes on a small machine); on a GPU, nothing
        before_deepspeed_starts()
    else:
        from hf_grpo import GRPOConfig, GRPOTrainer
    common = dict(
        output_dir=os.path.join(workdir, "out"), per_device_train_batch_size=args.per_device_train_batch_size,
        steps_per_generation=args.steps_per_generation, gradient_accumulation_steps=args.gradient_accumulation_steps,
        num_generations=args.num_generations, max_completion_length=args.max_completion_length, beta=args.beta,
        learning_rate=args.learning_rate, temperature=args.temperature, max_steps=args.max_steps, logging_steps=1,
        save_strategy="no", report_to=[], bf16=args.bf16, disable_tqdm=True, seed=args.seed,
        num_iterations=args.num_iterations,
    )
    if args.full_length:
        common["generation_kwargs"] = {"min_new_tokens": args.max_completion_length}
    if device == "cpu":
        common["use_cpu"] = True
    if args.checkpointing != "default":
        common["activation_checkpointing"] = args.checkpointing == "on"
    if args.impl == "hf_grpo":
        common.update(generation_backend=args.backend, tensor_batch_size=args.tensor_batch_size,
                      per_device_generation_batch_size=args.per_device_generation_batch_size)
        if args.cudnn_attention != "default":
            common["cudnn_attention"] = args.cudnn_attention == "on"
        if args.padding_free != "default":
            common["padding_free"] = args.padding_free == "on"
        if args.compile_training != "default":
            common["compile_training"] = args.compile_training
        if args.compile_generation != "default":
            common["compile_generation"] = args.compile_generation
        if args.lora_generation_mirror != "default":
            common["lora_generation_mirror"] = args.lora_generation_mirror
        if args.training_cuda_graphs != "default":
            common["training_cuda_graphs"] = args.training_cuda_graphs
        if args.zero3_generation_mirror != "default":
            common["zero3_generation_mirror"] = args.zero3_generation_mirror
        if args.release_generation_memory != "default":
            common["release_generation_memory"] = args.release_generation_memory == "on"
        if args.dense_mirror_in_one_process:
            from hf_grpo.generation import dense_mirror

            # as on several processes, where no rank holds its partitions whole
            dense_mirror.partitions_whole = lambda model, device: False
        if args.old_logprobs_source != "default":
            common["old_logprobs_source"] = args.old_logprobs_source
        if args.lora_fused_forward != "default":
            common["lora_fused_forward"] = args.lora_fused_forward == "on"
        if args.true_on_policy:
            common["true_on_policy"] = True
        if args.shape_reuse_capture_cost is not None:
            from hf_grpo.training import shape_reuse

            shape_reuse.CAPTURE_COST = args.shape_reuse_capture_cost  # read when the graphs start, at train begin
        from hf_grpo.training import padding_free, prompt_groups

        padding_free.SHARE_PROMPTS = args.share_prompts == "on"
        prompt_groups.GROUP_PROMPTS = args.group_prompts == "on"
    else:
        if args.cudnn_attention != "default":
            torch.backends.cuda.enable_cudnn_sdp(args.cudnn_attention == "on")
        if args.trl_continuous_batching:
            common["use_transformers_continuous_batching"] = True
    config = GRPOConfig(**common)

    timer = StepTimer(device, args.max_seconds)
    callbacks = [timer]
    if args.profile_step is not None:
        label = (("trl_cb" if args.trl_continuous_batching else "trl") if args.impl == "trl"
                 else f"{args.impl}_{args.backend}")
        profiler = StepProfiler(args.profile_step, args.profile_dir, args.label or label, args.profile_after_generation,
                                args.profile_with_stack)
        callbacks.append(profiler)
    peft_config = None
    if args.lora_r:
        from peft import LoraConfig

        peft_config = LoraConfig(r=args.lora_r, lora_alpha=2 * args.lora_r, task_type="CAUSAL_LM",
                                 target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                 "down_proj"])
    trainer = GRPOTrainer(model=model, reward_funcs=random_reward, args=config, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=callbacks, peft_config=peft_config)
    # with LoRA the reference is the policy with its adapters disabled (no second model)
    assert (trainer.ref_model is not None) == (args.beta != 0 and not args.lora_r), "the reference model is missing"

    rollouts = []
    generate = trainer._generate_single_turn
    # Peak memory by phase: the allocator's peak is read and reset at each generation's start and end,
    # so "generation" is the highest peak inside a rollout's generation, "other" outside (scoring, training).
    # The reserved peak likewise, over every phase (a reset clears both peaks).
    phase_peaks = {"generation": 0, "other": 0}
    reserved_peak = [0]

    def close_phase(phase):
        if device == "cuda":
            torch.cuda.synchronize()
            phase_peaks[phase] = max(phase_peaks[phase], torch.cuda.max_memory_allocated())
            reserved_peak[0] = max(reserved_peak[0], torch.cuda.max_memory_reserved())
            torch.cuda.reset_peak_memory_stats()

    def timed_generate(*a, **k):
        close_phase("other")
        cuda_sync(device)
        t0 = time.perf_counter()
        out = generate(*a, **k)
        cuda_sync(device)
        close_phase("generation")
        lengths = [len(ids) for ids in out[0]]
        rollouts.append(dict(s=time.perf_counter() - t0, completions=len(lengths), tokens=sum(lengths),
                             max_len=max(lengths)))
        return out

    trainer._generate_single_turn = timed_generate
    if args.profile_step is not None and args.profile_after_generation:
        profiler.watch_generation(trainer)
    phases = None
    if args.phases:
        from phase_timer import PhaseTimer  # bench/phase_timer.py

        phases = PhaseTimer(trainer, device)

    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.synchronize()
        weights_gib = torch.cuda.memory_allocated() / 2**30  # policy + reference model, before any optimizer state
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    trainer.train()
    cuda_sync(device)
    train_s = time.perf_counter() - t0
    close_phase("other")

    steps = [entry for entry in trainer.state.log_history if "completions/mean_length" in entry]
    lengths = {key: [round(entry[f"completions/{key}"], 1) for entry in steps]
               for key in ("mean_length", "min_length", "max_length")}
    clipped = [round(entry["completions/clipped_ratio"], 3) for entry in steps]
    total_tokens = sum(r["tokens"] for r in rollouts)
    total_completions = sum(r["completions"] for r in rollouts)
    gen_s = sum(r["s"] for r in rollouts)
    decisions = trainer.decisions if args.impl == "hf_grpo" else None  # what the run chose (hf_grpo.run_state)
    record = dict(
        bench="grpo_realistic",
        impl=args.impl,
        backend=getattr(getattr(trainer, "_backend", None), "name", None) or (
            ("trl_continuous_batching" if args.trl_continuous_batching else "trl") if args.impl == "trl"
            else args.backend),
        backend_requested=args.backend if args.impl == "hf_grpo" else "trl",
        model_shape=args.shape, dtype="bfloat16" if args.bf16 else "float32", device=device,
        completions_per_step=args.per_device_train_batch_size * args.gradient_accumulation_steps,
        per_device_train_batch_size=args.per_device_train_batch_size, steps_per_generation=args.steps_per_generation,
        gradient_accumulation_steps=args.gradient_accumulation_steps, num_generations=args.num_generations,
        max_completion_length=args.max_completion_length, prompt_len_range=[args.min_prompt, args.max_prompt],
        beta=args.beta, num_iterations=args.num_iterations, lora_r=args.lora_r, full_length=args.full_length,
        padding_free=getattr(trainer.args, "padding_free", None),
        compile_training=decisions.train_layers is not None if decisions else None,
        compile_generation=getattr(trainer.args, "compile_generation", None),
        decode_compiled=getattr(getattr(decisions, "backend", None), "compile", None),
        training_cuda_graphs=decisions.graphs_replay if decisions else None,
        training_graphs_failure=getattr(getattr(decisions, "train_graphs", None), "failure", None),
        shape_reuse_capture_cost=getattr(getattr(getattr(decisions, "train_graphs", None), "reuse", None),
                                         "capture_cost", None),
        generation_mirror=str(decisions.mirror) if decisions else None,
        release_generation_memory=getattr(trainer.args, "release_generation_memory", None),
        dense_mirror_in_one_process=args.dense_mirror_in_one_process or None,
        lora_fused_layers=getattr(decisions, "lora_fused_layers", None),
        share_prompts=args.share_prompts == "on" if args.impl == "hf_grpo" else None,
        prompt_grouping=getattr(decisions, "prompt_grouping", None),
        checkpointing=bool(trainer.args.activation_checkpointing),
        tensor_batch_size=args.tensor_batch_size if args.impl == "hf_grpo" else None,
        per_device_generation_batch_size=(trainer.sizes.per_device_generation_batch_size
                                          if args.impl == "hf_grpo" else None),
        cudnn_attention=torch.backends.cuda.cudnn_sdp_enabled() if args.impl == "trl" else config.cudnn_attention,
        eager_rows=str(decisions.eager_rows) if decisions else None,
        launch=dict(launch_info(), config=args.launch_config),
        label=args.label, compile_cache_dir=os.environ.get("TORCHINDUCTOR_CACHE_DIR"),
        max_steps=args.max_steps, steps_done=trainer.state.global_step, stopped_early=timer.stopped_early,
        # times: every step, the first (warm-up) included
        train_s=round(train_s, 2),
        step_s=[round(t, 3) for t in timer.times],
        step_s_total=round(sum(timer.times), 2),
        step_s_mean_after_first=round(sum(timer.times[1:]) / len(timer.times[1:]), 3) if len(timer.times) > 1 else None,
        generation_s=[round(r["s"], 3) for r in rollouts],
        generation_s_total=round(gen_s, 2),
        generation_share=round(gen_s / train_s, 3) if train_s else None,
        generated_tokens=total_tokens, completions=total_completions,
        generated_tokens_per_s=round(total_tokens / gen_s, 1) if gen_s else None,
        rollout_max_len=[r["max_len"] for r in rollouts],
        completion_len_mean=lengths["mean_length"], completion_len_min=lengths["min_length"],
        completion_len_max=lengths["max_length"], clipped_ratio=clipped,
        completion_len_mean_overall=round(total_tokens / total_completions, 1) if total_completions else None,
        loss=[round(entry["loss"], 5) for entry in steps if "loss" in entry],
        kl=[round(entry["kl"], 6) for entry in steps if "kl" in entry],
        # sampler against trainer, per token, on each step that measured it (hf_grpo's rollout_logprobs/*)
        rollout_logprobs={name: [entry[f"rollout_logprobs/{name}"] for entry in trainer.state.log_history
                                 if f"rollout_logprobs/{name}" in entry]
                          for name in ("abs_diff_mean", "abs_diff_p99", "abs_diff_max", "outside_clip_share")},
        old_logprobs_source=getattr(config, "old_logprobs_source", None),
        true_on_policy=getattr(config, "true_on_policy", None),
        eos=calibration,
        build_s=round(build_s, 2),
    )
    if device == "cuda":
        record.update(
            weights_gib=round(weights_gib, 3),
            peak_mem_gib=round(max(phase_peaks.values()) / 2**30, 3),
            peak_generation_gib=round(phase_peaks["generation"] / 2**30, 3),
            peak_outside_generation_gib=round(phase_peaks["other"] / 2**30, 3),
            peak_reserved_gib=round(max(reserved_peak[0], torch.cuda.max_memory_reserved()) / 2**30, 3),
            gpu=torch.cuda.get_device_name(),
        )
    else:
        record.update(gpu=None, cpu=platform.processor() or platform.machine())
    if phases is not None:
        record["phases"] = phases.summary()
    record["torch_compile"] = compile_report()
    if args.impl == "hf_grpo":
        stats = trainer.get_performance_stats()
        stats.pop("batch_plan", None)
        record["perf"] = {key: round(value, 4) if isinstance(value, float) else value for key, value in stats.items()}
    # Each rank's own figures (the record's top level is rank 0's): its steps, phases, peaks and hf_grpo's stats
    own = ("step_s", "generation_s", "phases", "perf", "weights_gib", "peak_mem_gib", "peak_generation_gib",
           "peak_outside_generation_gib", "peak_reserved_gib", "gpu")
    record["per_rank"] = gather_ranks({"rank": launch_info()["rank"], **{k: record[k] for k in own if k in record}})
    record["versions"] = dict(
        python=platform.python_version(), torch=torch.__version__, transformers=transformers.__version__,
        trl=trl.__version__, datasets=datasets.__version__,
        cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version() if device == "cuda" else None,
    )
    from hf_grpo import close_distributed

    close_distributed(trainer)  # (under accelerate launch: every process exits cleanly; else nothing)
    if launch_info()["rank"] != 0:  # rank 0 writes the run's one record, every rank's figures in it
        shutil.rmtree(workdir, ignore_errors=True)
        return 0
    line = json.dumps(with_provenance(record))
    print("RESULT", line, flush=True)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "a") as handle:
            handle.write(line + "\n")
    shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
