"""diffu-GRPO on one GPU: an 8B LLaDA-shaped model with LoRA, hf_grpo's sampler and estimator vs the plain algorithm.

One process, CUDA, bf16. The model is a random-init Llama with LLaDA-8B's shape (hidden 4096, 32 layers,
32 heads without GQA, intermediate 12288, vocabulary 126464, mask id 126336, untied head) made
bidirectional with ``is_causal=False`` (as ``hf_grpo.recipe_support.diffusion_tiny`` does), plus a LoRA adapter (r 128,
alpha 64, dropout 0.05 on every projection) through peft. Prompts have random lengths (``--prompt-len``,
uniform, left-padded) and random tokens.

**plain** is the published algorithm, written out here:

* rollout (LLaDA's ``generate``): every step runs the whole row, projects EVERY position through the LM
  head, adds Gumbel noise as ``exp(logits) / (-log u)^T`` and takes the softmax, both in float64 over the
  whole ``[B, T, V]``, and commits the top-k confident masked tokens of the current block with a top-k
  per row (a host sync per row). One deviation, shared with hf_grpo's default (``forbid_mask_token``): the
  mask token's logit is set to -inf (a random-init model would otherwise "predict" the mask and commit it);
  ``plain_generate(forbid_mask_token=False)`` is LLaDA's code without it;
* scoring (d1's ``_get_per_token_logps``): the old and reference log-probs of one rollout for all
  ``num_iterations`` mask seeds in ONE forward over ``num_iterations x rows`` sequences, with the full
  ``[rows, T, V]`` logits and a cross-entropy over the completion's ``[rows x L, V]`` slice;
* train step: the same full-logit log-probs for a micro-batch, a GRPO-style loss, backward.

**ours** is hf_grpo: ``DiffusionSampler`` chunked by ``per_device_generation_batch_size`` (``gen_batch``;
the LM head, noise and softmax on the current block only, no host sync per step), optionally with the
approximate block cache (``ours_cache_dual`` / ``ours_cache_prefix``: ``block_cache="dual"`` /
``"prefix"``, see ``hf_grpo/diffusion/block_cache.py``; not exact; ``dual`` replays its cached step from a
CUDA graph, ``ours_cache_dual_eager`` runs it eagerly; its full forwards bounded by
``--rollout-tensor-batch`` token rows, as the trainer passes its ``tensor_batch_size``), and
``masked_logprobs`` chunked by ``per_device_train_batch_size`` rows and ``tensor_batch_size`` token rows.

Each record is a JSON line: rollout (seconds, completion tokens/s, peak memory), score (old + ref
log-probs of a rollout for all mu seeds), train_step (forward + backward of one micro-batch), and a
summary with the ratios against plain. ``peak_gib`` is ``torch.cuda.max_memory_allocated`` (reset before
each run); ``peak_above_model_gib`` subtracts the model and adapter. A run that runs out of memory is
recorded with ``"oom": true``. Every measured call follows an untimed warm-up of the same kind.

    python bench/diffu_llada.py --out $OUT/diffu.jsonl        # one H100, ~4-6 minutes
    python bench/diffu_llada.py --layers 4 --steps 32          # a quick GPU check
    python bench/diffu_llada.py --tiny                         # CPU smoke run, a tiny shape
    python bench/diffu_llada.py --table $OUT/diffu.jsonl       # the records as a Markdown table
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/: provenance.py
from provenance import with_provenance  # noqa: E402
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from hf_grpo.diffusion.logprobs import EstimatorSpec, masked_logprobs, rollout_mask_seeds  # noqa: E402
from hf_grpo.diffusion.model import left_pad_tensors  # noqa: E402
from hf_grpo.diffusion.sampler import DiffusionSampler  # noqa: E402

GIB = 2**30
LLADA_8B = dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=32, vocab_size=126464, max_position_embeddings=4096, rms_norm_eps=1e-5,
                rope_parameters={"rope_type": "default", "rope_theta": 500000.0}, tie_word_embeddings=False)
LLADA_IDS = dict(mask=126336, pad=126081)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
            vocab_size=320, max_position_embeddings=512, tie_word_embeddings=False)
TINY_IDS = dict(mask=300, pad=0)
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


# ---- the plain published algorithm --------------------------------------------------------------------------
def plain_gumbel(logits: torch.Tensor, temperature: float, uniform) -> torch.Tensor:
    """LLaDA's ``add_gumbel_noise``: ``exp(l) / (-log u)^T`` in float64 (its argmax draws from softmax(l / T))."""
    if temperature == 0:
        return logits
    logits = logits.to(torch.float64)
    return logits.exp() / (-torch.log(uniform(logits.shape, logits.device))) ** temperature


def plain_transfer_counts(block_masked: torch.Tensor, steps: int) -> torch.Tensor:
    """LLaDA's ``get_num_transfer_tokens``: ``[B, steps]`` tokens to commit, remainder to the first steps."""
    masked = block_masked.sum(dim=1, keepdim=True)
    base, remainder = masked // steps, masked % steps
    counts = torch.zeros(masked.size(0), steps, device=block_masked.device, dtype=torch.int64) + base
    for row in range(masked.size(0)):
        counts[row, : remainder[row]] += 1
    return counts


@torch.no_grad()
def plain_generate(model, prompt: torch.Tensor, attention_mask: torch.Tensor | None, *, steps: int, gen_length: int,
                   block_length: int, temperature: float, mask_id: int, generator=None, uniform=None,
                   forbid_mask_token: bool = True) -> torch.Tensor:
    """LLaDA's published ``generate`` (low-confidence remasking, no CFG) for a left-padded ``prompt`` [B, P].

    ``uniform(shape, device)`` supplies the float64 uniforms of the Gumbel noise (default: ``torch.rand``
    with ``generator``); tests hand it the draws the block-only sampler sees. Returns ``[B, gen_length]``.
    """
    uniform = uniform or (lambda shape, device: torch.rand(shape, dtype=torch.float64, device=device,
                                                           generator=generator))
    rows, width = prompt.shape
    x = torch.full((rows, width + gen_length), mask_id, dtype=torch.long, device=prompt.device)
    x[:, :width] = prompt
    if attention_mask is not None:
        attention_mask = torch.cat([attention_mask, torch.ones_like(x[:, width:])], dim=1)
    blocks = gen_length // block_length
    steps_per_block = steps // blocks
    for block in range(blocks):
        end = width + (block + 1) * block_length
        counts = plain_transfer_counts(x[:, end - block_length:end] == mask_id, steps_per_block)
        for step in range(steps_per_block):
            mask_index = x == mask_id
            logits = model(x, attention_mask=attention_mask).logits  # [B, T, V]: every position
            if forbid_mask_token:
                logits[..., mask_id] = float("-inf")  # the one deviation (see the module docstring)
            x0 = torch.argmax(plain_gumbel(logits, temperature, uniform), dim=-1)
            p = F.softmax(logits.to(torch.float64), dim=-1)
            x0_p = torch.gather(p, -1, x0.unsqueeze(-1)).squeeze(-1)
            x0_p[:, end:] = float("-inf")
            x0 = torch.where(mask_index, x0, x)
            confidence = torch.where(mask_index, x0_p, torch.full_like(x0_p, float("-inf")))
            transfer = torch.zeros_like(x0, dtype=torch.bool)
            for row in range(rows):
                _, chosen = torch.topk(confidence[row], k=int(counts[row, step]))
                transfer[row, chosen] = True
            x[transfer] = x0[transfer]
    return x[:, width:]


def plain_masked_sequences(sequences, prompt_index, seeds, mask_id, p_mask_prompt):
    """d1's ``forward_process`` per iteration: prompt tokens masked with probability p, every completion slot masked."""
    views = []
    for seed in seeds:
        generator = torch.Generator().manual_seed(int(seed))
        drawn = torch.rand(sequences.shape, generator=generator).to(sequences.device)  # d1 draws on the CPU
        hide_prompt = prompt_index & (drawn < p_mask_prompt)
        views.append(torch.where(hide_prompt | ~prompt_index, mask_id, sequences))
    return torch.cat(views)


def plain_logps(model, sequences, attention_mask, prompt_index, seeds, completion, mask_id, p_mask_prompt):
    """d1's ``_get_per_token_logps``: one forward over all ``len(seeds) x B`` views, full logits, cross-entropy."""
    views = plain_masked_sequences(sequences, prompt_index, seeds, mask_id, p_mask_prompt)
    mask = attention_mask.repeat(len(seeds), 1) if attention_mask is not None else None
    logits = model(views, attention_mask=mask).logits
    length = completion.size(1)
    completion_logits = logits[:, -length:, :]
    targets = completion.repeat(len(seeds), 1)
    loss = F.cross_entropy(completion_logits.reshape(-1, completion_logits.size(-1)), targets.reshape(-1),
                           reduction="none")
    return -loss.view(len(seeds), completion.size(0), length).float()


# ---- harness ------------------------------------------------------------------------------------------------
def build_model(args, device, dtype):
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    dims = dict(TINY if args.tiny else LLADA_8B)
    if args.layers:
        dims["num_hidden_layers"] = args.layers
    ids = TINY_IDS if args.tiny else LLADA_IDS
    config = LlamaConfig(**dims, is_causal=False, use_cache=False, mask_token_id=ids["mask"],
                         pad_token_id=ids["pad"], attn_implementation="sdpa")
    torch.manual_seed(args.seed)
    with torch.device(device):
        model = LlamaForCausalLM._from_config(config, dtype=dtype)
    lora = LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=0.05, target_modules=LORA_TARGETS,
                      task_type="CAUSAL_LM")
    # adapter weights in the model's dtype: peft's default fp32 copy would run every LoRA matmul in fp32
    # here (the trainer runs them under bf16 autocast instead)
    model = get_peft_model(model, lora, autocast_adapter_dtype=False)
    return model.eval(), dims, ids


class Meter:
    """Wall time and peak allocated memory of one measured call; records an out-of-memory instead of raising."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def reset(self):
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()

    def run(self, fn):
        self.reset()
        start = time.perf_counter()
        try:
            result = fn()
            if self.cuda:
                torch.cuda.synchronize()
        except torch.OutOfMemoryError:
            result = None
            self.reset()
            return {"oom": True}, None
        seconds = time.perf_counter() - start
        figures = {"oom": False, "seconds": round(seconds, 3)}
        if self.cuda:
            figures["peak_gib"] = round(torch.cuda.max_memory_allocated() / GIB, 3)
        return figures, result


def make_prompts(args, vocab, ids):
    rng = random.Random(args.seed)
    low, high = (int(v) for v in args.prompt_len.split("-")) if "-" in args.prompt_len else (int(args.prompt_len),) * 2
    top = min(vocab, ids["mask"]) - 1
    return [[rng.randrange(2, top) for _ in range(rng.randint(low, high))] for _ in range(args.rollout)]


def rollout_plain(model, prompts, args, ids, gen_batch, device, generator):
    out = []
    for begin in range(0, len(prompts), gen_batch):
        chunk = prompts[begin:begin + gen_batch]
        prompt, mask, padded = left_pad_tensors(chunk, ids["pad"], device)
        out.append(plain_generate(model, prompt, mask if padded else None, steps=args.steps,
                                  gen_length=args.gen_len, block_length=args.block, temperature=args.temperature,
                                  mask_id=ids["mask"], generator=generator))
    return torch.cat(out)


def rollout_ours(model, prompts, args, ids, gen_batch, block_cache):
    from transformers import GenerationConfig

    cuda_graph = None  # the sampler's default: the dual cache's step captured on CUDA
    if block_cache == "dual_eager":
        block_cache, cuda_graph = "dual", False
    sampler = DiffusionSampler(block_length=args.block, steps=args.steps, mask_token_id=ids["mask"],
                               block_cache=block_cache, cuda_graph=cuda_graph,
                               tensor_batch_size=args.rollout_tensor_batch or None)
    config = GenerationConfig(max_new_tokens=args.gen_len, do_sample=args.temperature > 0,
                              temperature=args.temperature or 1.0)
    return sampler.generate(model, prompts, generation_config=config, chunk_size=gen_batch, pad_token_id=ids["pad"],
                            eos_token_ids=[])


def score_batch(prompts, completions, ids, device):
    prompt, prompt_mask, padded = left_pad_tensors(prompts, ids["pad"], device)
    completion = torch.as_tensor(completions, dtype=torch.long, device=device)
    return prompt, prompt_mask, padded, completion


def plain_score(model, batch, seeds, ids, args):
    prompt, prompt_mask, padded, completion = batch
    sequences = torch.cat([prompt, completion], dim=1)
    attention = torch.cat([prompt_mask, torch.ones_like(completion)], dim=1) if padded else None
    prompt_index = torch.zeros_like(sequences, dtype=torch.bool)
    prompt_index[:, : prompt.size(1)] = prompt_mask.bool()  # padding is neither prompt nor completion
    with torch.no_grad():
        old = plain_logps(model, sequences, attention, prompt_index, seeds, completion, ids["mask"], args.p_mask_prompt)
        with model.disable_adapter():
            ref = plain_logps(model, sequences, attention, prompt_index, seeds, completion, ids["mask"],
                              args.p_mask_prompt)
    return old, ref


def ours_score(model, batch, seeds, spec, args):
    prompt, prompt_mask, _, completion = batch
    ones = torch.ones_like(completion)

    def all_seeds():
        return torch.stack([masked_logprobs(model, prompt, prompt_mask, completion, ones, seeds[:, k], spec,
                                            row_chunk=args.train_batch) for k in range(seeds.size(1))], dim=1)

    with torch.no_grad():
        old = all_seeds()
        with model.disable_adapter():
            ref = all_seeds()
    return old, ref


def grpo_loss(logps, advantages):
    ratio = torch.exp(logps - logps.detach())
    return -(ratio * advantages[:, None]).mean()


def train_plain(model, batch, seeds, ids, args):
    prompt, prompt_mask, padded, completion = batch
    sequences = torch.cat([prompt, completion], dim=1)
    attention = torch.cat([prompt_mask, torch.ones_like(completion)], dim=1) if padded else None
    prompt_index = torch.zeros_like(sequences, dtype=torch.bool)
    prompt_index[:, : prompt.size(1)] = prompt_mask.bool()
    logps = plain_logps(model, sequences, attention, prompt_index, [int(seeds[0])], completion, ids["mask"],
                        args.p_mask_prompt)[0]
    grpo_loss(logps, torch.linspace(-1, 1, completion.size(0), device=completion.device)).backward()


def train_ours(model, batch, seeds, spec):
    prompt, prompt_mask, _, completion = batch
    logps = masked_logprobs(model, prompt, prompt_mask, completion, torch.ones_like(completion), seeds, spec)
    grpo_loss(logps, torch.linspace(-1, 1, completion.size(0), device=completion.device)).backward()


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=None, help="diffusion steps (published: 128)")
    parser.add_argument("--gen-len", type=int, default=None, help="completion tokens (published: 256)")
    parser.add_argument("--block", type=int, default=None, help="block length (published: 32)")
    parser.add_argument("--prompt-len", default=None, help="prompt lengths, uniform LOW-HIGH (default 64-256)")
    parser.add_argument("--rollout", type=int, default=None, help="prompts per rollout (default 8)")
    parser.add_argument("--gen-batches", default=None, help="per_device_generation_batch_size values (default 8,4)")
    parser.add_argument("--tensor-batch-sizes", default=None, help="tensor_batch_size values (default 256,1024)")
    parser.add_argument("--caches", default="dual,dual_eager,prefix",
                        help="approximate block caches to time ('' for none); dual_eager: dual without the CUDA graph")
    parser.add_argument("--rollout-tensor-batch", type=int, default=1024,
                        help="tensor_batch_size the sampler gets, as the trainer passes it (the guide's 1024; 0: none)")
    parser.add_argument("--train-batch", type=int, default=None, help="per_device_train_batch_size (default 4)")
    parser.add_argument("--iterations", type=int, default=None, help="num_iterations mu (published: 12)")
    parser.add_argument("--temperature", type=float, default=0.9)
    parser.add_argument("--p-mask-prompt", type=float, default=0.15)
    parser.add_argument("--lora-r", type=int, default=128)
    parser.add_argument("--lora-alpha", type=int, default=64)
    parser.add_argument("--layers", type=int, default=None, help="fewer layers than the shape's, for a quick check")
    parser.add_argument("--rollout-budget-s", type=float, default=270.0,
                        help="start no rollout measurement after this many seconds (skipped ones are recorded)")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run with a tiny shape and small settings")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="also write the JSON lines to this file")
    parser.add_argument("--table", default=None, metavar="JSONL", help="print a Markdown table of a run's records")
    args = parser.parse_args(argv)
    if args.table:
        with open(args.table) as handle:
            print(markdown_table([json.loads(line) for line in handle if line.strip()]))
        return []
    defaults = (dict(steps=8, gen_len=16, block=8, prompt_len="4-12", rollout=4, gen_batches="2,4",
                     tensor_batch_sizes="16,64", train_batch=2, iterations=2) if args.tiny else
                dict(steps=128, gen_len=256, block=32, prompt_len="64-256", rollout=8, gen_batches="8,4",
                     tensor_batch_sizes="256,1024", train_batch=4, iterations=12))
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if not args.tiny and not torch.cuda.is_available():
        parser.error("needs a CUDA device (use --tiny for a CPU smoke run)")
    device = torch.device("cpu" if args.tiny else "cuda")
    dtype = torch.float32 if args.tiny else torch.bfloat16
    gen_batches = [int(v) for v in args.gen_batches.split(",")]
    tensor_batch_sizes = [int(v) for v in args.tensor_batch_sizes.split(",")]
    caches = [c for c in args.caches.split(",") if c]
    records: list[dict] = []
    out = open(args.out, "w") if args.out else None

    def emit(record):
        record = with_provenance(record)
        records.append(record)
        line = json.dumps(record)
        print(line, flush=True)
        if out:
            out.write(line + "\n")
            out.flush()

    started = time.perf_counter()
    model, dims, ids = build_model(args, device, dtype)
    meter = Meter(device)
    model_gib = torch.cuda.memory_allocated() / GIB if meter.cuda else 0.0
    prompts = make_prompts(args, dims["vocab_size"], ids)
    setting = dict(steps=args.steps, gen_len=args.gen_len, block=args.block, prompt_len=args.prompt_len,
                   rollout=args.rollout, temperature=args.temperature, iterations=args.iterations,
                   train_batch=args.train_batch, p_mask_prompt=args.p_mask_prompt)
    emit(dict(what="setup", device=torch.cuda.get_device_name(0) if meter.cuda else "cpu", dtype=str(dtype),
              shape="tiny" if args.tiny else "llada-8b", layers=dims["num_hidden_layers"],
              parameters_b=round(sum(p.numel() for p in model.parameters()) / 1e9, 3),
              lora=dict(r=args.lora_r, alpha=args.lora_alpha, targets=LORA_TARGETS, dtype=str(dtype)), model_gib=round(model_gib, 3),
              torch=torch.__version__, published_settings=(args.steps, args.gen_len, args.block) == (128, 256, 32),
              prompt_lengths=[len(p) for p in prompts], gradient_checkpointing=False,
              note="plain = LLaDA generate / d1 scoring written out in bench/diffu_llada.py; one rollout of "
                   f"{args.rollout} prompts per measurement", **setting))

    # ---- rollout --------------------------------------------------------------------------------------------
    completions = None
    rollout = {}
    impls = ["plain", "ours"] + [f"ours_cache_{c}" for c in caches]
    warm_args = argparse.Namespace(**{**vars(args), "gen_len": args.block, "steps": 2})
    for gen_batch in gen_batches:
        for impl in impls:
            def call(run_args):
                generator = torch.Generator(device=device).manual_seed(args.seed)
                if impl == "plain":
                    return rollout_plain(model, prompts, run_args, ids, gen_batch, device, generator)
                cache = impl.removeprefix("ours_cache_") if impl.startswith("ours_cache_") else None
                return rollout_ours(model, prompts, run_args, ids, gen_batch, cache)

            record = dict(what="rollout", impl=impl, gen_batch=gen_batch, exact=not impl.startswith("ours_cache"))
            if impl != "plain":
                record["tensor_batch_size"] = args.rollout_tensor_batch or None
            if time.perf_counter() - started > args.rollout_budget_s:  # keep the run inside one device call
                record.update(skipped=f"over --rollout-budget-s {args.rollout_budget_s}", oom=False)
                rollout[(impl, gen_batch)] = record
                emit(record)
                continue
            meter.run(lambda: call(warm_args))  # warm-up: kernels, allocator
            figures, result = meter.run(lambda: call(args))
            record.update(figures)
            if not figures["oom"]:
                record["tokens_per_s"] = round(args.rollout * args.gen_len / figures["seconds"], 1)
                if meter.cuda:
                    record["peak_above_model_gib"] = round(figures["peak_gib"] - model_gib, 3)
            if impl == "ours" and result is not None and completions is None:
                completions = [row + [ids["pad"]] * (args.gen_len - len(row)) for row in result]
            rollout[(impl, gen_batch)] = record
            emit(record)
            del result

    # ---- scoring (old + ref log-probs, all mu seeds) and a train step ------------------------------------------
    if completions is None:  # ours did not run to the end: score random completions of the same length
        rng = random.Random(args.seed + 1)
        completions = [[rng.randrange(2, ids["mask"] - 1) for _ in range(args.gen_len)] for _ in prompts]
    batch = score_batch(prompts, completions, ids, device)
    seeds = rollout_mask_seeds(args.seed, 0, range(len(prompts)), args.iterations)  # [R, mu]
    score = {}
    plain_seeds = seeds[0].tolist()  # d1: one seed per iteration for the whole batch
    for tensor_batch in [None] + tensor_batch_sizes:
        if tensor_batch is None:
            run = lambda: plain_score(model, batch, plain_seeds, ids, args)  # noqa: E731
        else:
            spec = EstimatorSpec(mask_token_id=ids["mask"], pad_token_id=ids["pad"], completion_slots=args.gen_len,
                                 p_mask_prompt=args.p_mask_prompt, temperature=args.temperature,
                                 tensor_batch_size=tensor_batch, padding_style="mask2d")
            run = lambda: ours_score(model, batch, seeds, spec, args)  # noqa: E731
        meter.run(run)  # warm-up
        figures, _ = meter.run(run)
        record = dict(what="score", impl="plain" if tensor_batch is None else "ours", tensor_batch_size=tensor_batch,
                      rows=len(prompts), iterations=args.iterations, row_chunk=None if tensor_batch is None else
                      args.train_batch, scored_tokens=2 * args.iterations * len(prompts) * args.gen_len, **figures)
        if meter.cuda and not figures["oom"]:
            record["peak_above_model_gib"] = round(figures["peak_gib"] - model_gib, 3)
        score[tensor_batch] = record
        emit(record)

    micro = tuple(t[: args.train_batch] for t in batch[:2]) + (batch[2], batch[3][: args.train_batch])
    model.train()
    train = {}
    for tensor_batch in [None] + tensor_batch_sizes:
        if tensor_batch is None:
            run = lambda: train_plain(model, micro, seeds[: args.train_batch, 0], ids, args)  # noqa: E731
        else:
            spec = EstimatorSpec(mask_token_id=ids["mask"], pad_token_id=ids["pad"], completion_slots=args.gen_len,
                                 p_mask_prompt=args.p_mask_prompt, temperature=args.temperature,
                                 tensor_batch_size=tensor_batch, padding_style="mask2d")
            run = lambda: train_ours(model, micro, seeds[: args.train_batch, 0], spec)  # noqa: E731
        meter.run(run)
        model.zero_grad(set_to_none=True)
        figures, _ = meter.run(run)
        model.zero_grad(set_to_none=True)
        record = dict(what="train_step", impl="plain" if tensor_batch is None else "ours",
                      tensor_batch_size=tensor_batch, rows=args.train_batch, **figures)
        if meter.cuda and not figures["oom"]:
            record["peak_above_model_gib"] = round(figures["peak_gib"] - model_gib, 3)
        train[tensor_batch] = record
        emit(record)
    model.eval()

    emit(summary(rollout, score, train, gen_batches, tensor_batch_sizes, caches, time.perf_counter() - started))
    if out:
        out.close()
    return records


def _ratio(numerator: dict, denominator: dict, key: str):
    if numerator.get("oom") or denominator.get("oom") or key not in numerator or key not in denominator:
        return None
    return round(numerator[key] / denominator[key], 3) if denominator[key] else None


def summary(rollout, score, train, gen_batches, tensor_batch_sizes, caches, seconds) -> dict:
    """Ratios against plain: time plain / ours (> 1: ours faster) and peak memory plain / ours (> 1: ours smaller)."""
    record = dict(what="summary", wall_s=round(seconds, 1), rollout={}, score={}, train_step={})
    for gen_batch in gen_batches:
        plain = rollout[("plain", gen_batch)]
        for impl in ["ours"] + [f"ours_cache_{c}" for c in caches]:
            ours = rollout[(impl, gen_batch)]
            record["rollout"][f"{impl}@g{gen_batch}"] = dict(
                speedup=_ratio(plain, ours, "seconds"), memory_ratio=_ratio(plain, ours, "peak_gib"),
                memory_ratio_above_model=_ratio(plain, ours, "peak_above_model_gib"), plain_oom=plain["oom"])
    for name, table in (("score", score), ("train_step", train)):
        for tensor_batch in tensor_batch_sizes:
            plain, ours = table[None], table[tensor_batch]
            record[name][f"t{tensor_batch}"] = dict(
                speedup=_ratio(plain, ours, "seconds"), memory_ratio=_ratio(plain, ours, "peak_gib"),
                memory_ratio_above_model=_ratio(plain, ours, "peak_above_model_gib"), plain_oom=plain["oom"])
    record["targets"] = "rollout: speedup >= 3 (the block caches are approximate; 'ours' is exact); " \
                        "memory_ratio >= 2 at the published settings"
    return record


def markdown_table(records: list[dict]) -> str:
    """One row per measurement: what, implementation, chunk size, seconds, tokens/s, peak memory, speed-up."""
    rows = ["| measurement | impl | gen batch g / tensor_batch_size t | seconds | tokens/s | peak GiB "
            "(above model) | plain time / this time |", "|---|---|---|---|---|---|---|"]
    plain = {}
    for r in records:
        if r.get("what") not in ("rollout", "score", "train_step"):
            continue
        key = (r["what"], r.get("gen_batch"))
        if r["impl"] == "plain":
            plain[key] = r
        chunk = f"g={r['gen_batch']}" if r["what"] == "rollout" else (
            f"t={r['tensor_batch_size']}" if r["tensor_batch_size"] else "unchunked")
        base = plain.get(key, {})
        speedup = (f"{base['seconds'] / r['seconds']:.2f}" if "skipped" not in r and "seconds" in base and "seconds" in r and
                   r is not base else "")
        peak = (f"{r['peak_gib']:.1f} ({r['peak_above_model_gib']:.1f})" if "peak_gib" in r else "")
        rows.append(f"| {r['what']} | {r['impl']} | {chunk} | {'OOM' if r['oom'] else r.get('seconds', 'skipped')} | "
                    f"{r.get('tokens_per_s', '')} | {peak} | {speedup} |")
    return "\n".join(rows)


if __name__ == "__main__":
    main()
