"""Rollout throughput: TRL's default GRPO generation vs hf_grpo's "hf" and "cuda_graph" backends.

All backends run in one process on one GPU, on the same random-init Qwen2-shaped bf16 model,
with the same generation settings (TRL's ``GRPOTrainer.generation_config``: sampling at
temperature 1, no top-k/top-p, plus ``min_new_tokens`` = completion length so that every
backend generates the same number of tokens), 64-token prompts.

(a) ``trl``: ``trl.GRPOTrainer._generate_single_turn`` on a trainer built like
    TRL's own defaults (``trl.GRPOConfig`` with only the batch and length fields set): all of a
    device's completions in one ``model.generate`` call.
    When TRL cannot be imported, ``model.generate`` with the same settings is timed
    instead; the record's ``trl_path`` says which.
(b) ``hf``: ``HFGenerateBackend`` (``model.generate`` per chunk).
(c) ``cuda_graph``: ``CudaGraphBackend`` (decode step compiled with ``torch.compile`` when
    available, then captured; its defaults); ``cuda_graph_sdpa`` and ``cuda_graph_matmul``: the same with
    ``decode_attention="sdpa"`` / ``"matmul"`` (attention over the whole cache); ``cuda_graph_nocompile``: captured without compiling;
    ``cuda_graph_whole_model``: the whole one-token forward compiled (``compile_scope="model"``)
    instead of one decoder layer.

Each backend's first full-length call (cold: cuDNN plans for every KV length, compiling,
capturing) is not timed; it is reported as ``first_call_s``. The ``hf`` backend runs after
the ``trl`` call on the same shapes and is already warm.

Prints one JSON object per line; ``--out FILE`` also writes the list.

    python bench/rollout.py --shapes 0.5b,1.5b --completions 32,128 --out bench/results/rollout_h100.json
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import random
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/: provenance.py
from provenance import with_provenance  # noqa: E402
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from hf_grpo.generation import HFGenerateBackend  # noqa: E402
from hf_grpo.generation.cuda_graph import CudaGraphBackend  # noqa: E402
from hf_grpo.recipe_support.tiny import build_tiny_model  # noqa: E402

VOCAB = 151936  # the vocabulary of the 0.5b and 1.5b shapes in hf_grpo.recipe_support.tiny.SHAPES
SHAPES = ("0.5b", "1.5b")
PAD, EOS = 0, 1


def gpu_short_name() -> str:
    name = torch.cuda.get_device_name(0)
    match = re.search(r"\b([A-Z]{1,2}\d{2,4}[A-Z]*)\b", name.upper())
    return (match.group(1) if match else name.split()[-1]).lower()


def build_tokenizer():
    """Token "t<i>" is id i (pad 0, eos 1): any id sequence round-trips, so prompts are plain random ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": PAD, "<eos>": EOS, **{f"t{i}": i for i in range(2, VOCAB)}}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece(prefix="##")
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>")


def build_model(shape: str, tokenizer):
    """The random-init Qwen2 shape of ``hf_grpo.recipe_support.tiny``, bf16 on the GPU (seed 0).

    Initialised on the GPU: a 7B shape's random init takes about a minute on the host's cores, seconds there."""
    with torch.device("cuda"):
        return build_tiny_model(tokenizer, shape=shape, dtype=torch.bfloat16)


def build_trl_trainer(model, tokenizer, completion_len: int):
    """A GRPOTrainer as the anchor builds it; returns (trainer, None) or (None, why not)."""
    try:
        from datasets import Dataset
        from trl import GRPOConfig, GRPOTrainer
    except Exception as err:  # noqa: BLE001 - any import problem means: time model.generate instead
        return None, f"{type(err).__name__}: {err}"
    rng = random.Random(0)
    dataset = Dataset.from_dict({"prompt": [" ".join(f"t{rng.randrange(2, VOCAB)}" for _ in range(64)) for _ in range(64)]})
    args = GRPOConfig(
        output_dir="/tmp/rollout_bench_trl",
        per_device_train_batch_size=8,
        num_generations=8,
        max_completion_length=completion_len,
        max_steps=1,
        report_to=[],
        save_strategy="no",
        bf16=True,
        disable_tqdm=True,
        temperature=1.0,
        generation_kwargs={"min_new_tokens": completion_len},
    )
    trainer = GRPOTrainer(
        model=model, reward_funcs=lambda completions, **kw: [0.0] * len(completions), args=args,
        train_dataset=dataset, processing_class=tokenizer,
    )
    return trainer, None


def trl_like_generation_config(completion_len: int) -> "GenerationConfig":
    """TRL 1.16's default generation settings, for when the trainer cannot be built."""
    from transformers import GenerationConfig

    return GenerationConfig(
        max_new_tokens=completion_len, min_new_tokens=completion_len, do_sample=True, pad_token_id=PAD,
        bos_token_id=None, eos_token_id=[EOS], temperature=1.0, top_p=1.0, top_k=0, min_p=None,
        repetition_penalty=1.0, cache_implementation=None, disable_compile=True,
    )


def timed(fn):
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, time.perf_counter() - start


def reset_memory():
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="0.5b,1.5b", help="comma-separated, from: " + ",".join(SHAPES))
    parser.add_argument("--completions", default="32,128", help="comma-separated completion counts")
    parser.add_argument("--completion-len", type=int, default=512)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument(
        "--backends", default="trl,hf,cuda_graph",
        help="from: trl, hf, cuda_graph (defaults: compiled decode step when available, "
        "decode_attention='filled'), cuda_graph_sdpa / cuda_graph_matmul (decode_attention='sdpa' / 'matmul'), "
        "cuda_graph_nocompile, "
        "cuda_graph_whole_model (compile_scope='model')",
    )
    parser.add_argument("--repeats", type=int, default=1, help="timed calls per backend (the fastest is kept)")
    parser.add_argument("--chunk-size", type=int, default=0, help="hf/cuda_graph chunk size (0: all completions at once)")
    parser.add_argument("--out", default=None, help="also write the JSON list here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/rollout.py needs a CUDA device", file=sys.stderr)
        return 2

    import transformers

    gpu_name = torch.cuda.get_device_name(0)
    gpu = gpu_short_name()
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    records = []
    tokenizer = build_tokenizer()

    for shape in [s.strip() for s in args.shapes.split(",") if s.strip()]:
        model = build_model(shape, tokenizer)
        trainer, trl_missing = (None, "not requested")
        if "trl" in backends:
            trainer, trl_missing = build_trl_trainer(model, tokenizer, args.completion_len)
            if trainer is not None:
                model = trainer.model  # the same object, as the trainer holds it
        gen_config = trainer.generation_config if trainer is not None else trl_like_generation_config(args.completion_len)
        gen_config = copy.deepcopy(gen_config)
        gen_config.min_new_tokens = args.completion_len
        gen_config.max_new_tokens = args.completion_len
        graph_backends = {
            "cuda_graph": CudaGraphBackend(),
            "cuda_graph_sdpa": CudaGraphBackend(decode_attention="sdpa"),
            "cuda_graph_matmul": CudaGraphBackend(decode_attention="matmul"),
            "cuda_graph_nocompile": CudaGraphBackend(compile=False),
            "cuda_graph_whole_model": CudaGraphBackend(compile_scope="model"),
        }
        trl_tps, warmed = {}, {}
        for n in [int(x) for x in args.completions.split(",") if x.strip()]:
            rng = random.Random(n)
            prompts = [[rng.randrange(2, VOCAB) for _ in range(args.prompt_len)] for _ in range(n)]
            chunk = args.chunk_size or n
            common = dict(pad_token_id=PAD, eos_token_ids=[EOS])
            for backend in backends:
                reset_memory()
                record = dict(
                    backend=backend, model_shape=shape, completions=n, completion_len=args.completion_len,
                    prompt_len=args.prompt_len, dtype="bfloat16",
                )
                # Every backend's first full-length call is not timed: the eager ones build cuDNN
                # attention plans for each new KV length (tens of seconds), the graph one compiles
                # and captures. first_call_s reports it; tokens_per_s is the steady state that a
                # training run sees on every later rollout of the same shape.
                with torch.no_grad():
                    if backend == "trl":
                        if trainer is not None:
                            record["trl_path"] = "trl.GRPOTrainer._generate_single_turn (model.generate, TRL generation config)"
                            full = trainer.generation_config
                            trainer.generation_config = gen_config
                            run = lambda: trainer._generate_single_turn(prompts, None, {}, 8)[0]  # noqa: E731
                        else:
                            record["trl_path"] = f"model.generate with TRL 1.16's default settings (TRL unavailable: {trl_missing})"
                            be = HFGenerateBackend()
                            run = lambda: be.generate(model, prompts, generation_config=gen_config, chunk_size=n, **common)  # noqa: E731
                    elif backend == "hf":
                        be = HFGenerateBackend()
                        run = lambda: be.generate(model, prompts, generation_config=gen_config, chunk_size=chunk, **common)  # noqa: E731
                        record["chunk_size"] = chunk
                    elif backend in graph_backends:
                        be = graph_backends[backend]
                        for other in graph_backends.values():
                            other.release()  # peak memory of this backend alone, and a fresh capture
                        captures = be.num_captures
                        run = lambda: be.generate(model, prompts, generation_config=gen_config, chunk_size=chunk, **common)  # noqa: E731
                        record.update(chunk_size=chunk, compiled=be.compile, decode_attention=be.decode_attention)
                    else:
                        raise SystemExit(f"unknown backend {backend!r}")
                    if backend == "hf" and warmed.get(n):
                        first = None  # the trl run of the same shapes warmed it
                    else:
                        _, first = timed(run)
                        warmed[n] = warmed.get(n) or backend == "trl"
                    best = None
                    for _ in range(args.repeats):
                        out_i, seconds_i = timed(run)
                        if best is None or seconds_i < best:
                            out, best = out_i, seconds_i
                    seconds = best
                    if backend == "trl" and trainer is not None:
                        trainer.generation_config = full
                    if backend.startswith("cuda_graph"):
                        record.update(captures=be.num_captures - captures, compile_error=be.compile_error,
                                      decode_attention_used=sorted({d.decode_attention for d in be._entries.values()}))
                    record["first_call_s"] = None if first is None else round(first, 3)
                tokens = sum(len(c) for c in out)
                record.update(
                    generated_tokens=tokens,
                    seconds=round(seconds, 3),
                    tokens_per_s=round(tokens / seconds, 1),
                    peak_mem_gib=round(torch.cuda.max_memory_allocated() / 2**30, 3),
                    peak_reserved_gib=round(torch.cuda.max_memory_reserved() / 2**30, 3),
                    gpu=gpu,
                    gpu_name=gpu_name,
                    torch=torch.__version__,
                    transformers=transformers.__version__,
                )
                if backend == "trl":
                    trl_tps[n] = record["tokens_per_s"]
                record["ratio_vs_trl"] = round(record["tokens_per_s"] / trl_tps[n], 2) if n in trl_tps else None
                record = with_provenance(record)
                records.append(record)
                print(json.dumps(record), flush=True)
                del out
        for be in graph_backends.values():
            be.release()
        del model, trainer, graph_backends
        reset_memory()

    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(records, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
