"""Where the first rollout of a fresh process spends its time (GPU only).

A run's first step pays once for what later rollouts reuse: the decode step's compile, the Triton kernels'
builds, the first capture. This script builds the random-init Qwen2 shape of ``hf_grpo.recipe_support.tiny``
in bf16, then times one rollout of the ``cuda_graph`` backend from a cold process (prompts of varied length,
TRL's sampling settings), split by stage:

* ``prefill_s``: the prompt forwards (eager) and the first token's pick;
* ``compile_call_s``: the decode step's first call outside the capture, where ``torch.compile`` runs;
* ``capture_s``: the warm-ups on the capture stream and the capture itself;
* ``replays_s``: the rest of ``run`` (the replayed steps);
* ``torch_compile``: torch's own counters (graphs, cache hits, seconds by stage: ``grpo_realistic.compile_report``).

Then the same call again in the same process (``second_call_s``: a capture, no compile, as after every
``release()``) and warm (``warm_call_s``: graph kept). ``--profile FILE`` writes a cProfile of the first call,
the functions by cumulative time. Run it twice with the same ``--compile-cache-dir`` to see a second run's first
call (warm compile cache). Prints one JSON object; ``--out FILE`` appends it.

    python bench/cold_start.py --shape 0.5b --batch 32 --min-prompt 32 --max-prompt 384 --completion-len 256
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, ".."), HERE]

from provenance import with_provenance  # noqa: E402

START = time.perf_counter()  # before torch's import: the process's own cold start counts

import torch  # noqa: E402

IMPORT_S = time.perf_counter() - START


class StageTimer:
    """Wraps the decoder's stages in synchronized wall-clock timers, summed by stage."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    def wrap(self, owner, name: str, stage: str) -> None:
        original = getattr(owner, name)

        def timed(*args, **kwargs):
            torch.cuda.synchronize()
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                torch.cuda.synchronize()
                self.seconds[stage] = self.seconds.get(stage, 0.0) + time.perf_counter() - start

        setattr(owner, name, timed)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="0.5b", choices=["0.5b", "1.5b"])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--min-prompt", type=int, default=32)
    parser.add_argument("--max-prompt", type=int, default=384)
    parser.add_argument("--completion-len", type=int, default=256)
    parser.add_argument("--compile", choices=["on", "off"], default="on")
    parser.add_argument("--compile-cache-dir", default=None,
                        help="torch's compile cache for this process (TORCHINDUCTOR_CACHE_DIR): a new folder is a cold "
                             "cache, one an earlier process filled a warm one")
    parser.add_argument("--warm-pool-before", type=float, default=0.0,
                        help="start inductor's compile workers this many seconds before the first call (0: torch's "
                             "own timing, at the first compile)")
    parser.add_argument("--profile", default=None, help="write a cProfile of the first call here (text)")
    parser.add_argument("--label", default="")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("cold_start needs a CUDA device")
    if args.compile_cache_dir:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = args.compile_cache_dir  # read by inductor when it first compiles

    from grpo_realistic import compile_report
    from rollout import EOS, PAD, VOCAB, build_model, build_tokenizer, trl_like_generation_config

    from hf_grpo.generation import static_decoder
    from hf_grpo.generation.cuda_graph import CudaGraphBackend

    start = time.perf_counter()
    model = build_model(args.shape, build_tokenizer()).eval()
    torch.cuda.synchronize()
    build_s = time.perf_counter() - start
    backend = CudaGraphBackend(compile=args.compile == "on")
    gc = trl_like_generation_config(args.completion_len)
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(args.min_prompt, args.max_prompt + 1, (args.batch,), generator=g).tolist()
    prompts = [torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in lengths]
    call = dict(generation_config=gc, chunk_size=args.batch, pad_token_id=PAD, eos_token_ids=[EOS])

    if args.warm_pool_before > 0:
        from torch._inductor.async_compile import maybe_warm_pool

        maybe_warm_pool()
        time.sleep(args.warm_pool_before)  # stands in for the rest of a trainer's set-up

    timer = StageTimer()
    decoder_class = static_decoder.StaticDecoder
    timer.wrap(decoder_class, "run", "run_s")
    timer.wrap(decoder_class, "_prefill", "prefill_s")
    timer.wrap(decoder_class, "_capture", "compile_and_capture_s")
    timer.wrap(static_decoder, "capture_graph", "capture_s")  # the name static_decoder calls

    profiler = cProfile.Profile() if args.profile else None
    torch.cuda.synchronize()
    start = time.perf_counter()
    if profiler:
        profiler.enable()
    backend.generate(model, prompts, **call)
    torch.cuda.synchronize()
    if profiler:
        profiler.disable()
    first_call_s = time.perf_counter() - start
    stages = dict(timer.seconds)
    timer.seconds.clear()

    backend.release(empty_cache=False)
    second_call_s = timed_call(backend, model, prompts, call)
    warm_call_s = timed_call(backend, model, prompts, call)

    first = {
        "first_call_s": round(first_call_s, 3),
        "prefill_s": round(stages.get("prefill_s", 0.0), 3),
        "compile_call_s": round(stages.get("compile_and_capture_s", 0.0) - stages.get("capture_s", 0.0), 3),
        "capture_s": round(stages.get("capture_s", 0.0), 3),
        "replays_s": round(stages.get("run_s", 0.0) - stages.get("prefill_s", 0.0)
                           - stages.get("compile_and_capture_s", 0.0), 3),
        "outside_run_s": round(first_call_s - stages.get("run_s", 0.0), 3),
    }
    record = {
        "bench": "cold_start", "label": args.label, "shape": args.shape, "batch": args.batch,
        "prompt_len_range": [args.min_prompt, args.max_prompt], "completion_len": args.completion_len,
        "compile": args.compile, "warm_pool_before_s": args.warm_pool_before, "compile_cache_dir": os.environ.get("TORCHINDUCTOR_CACHE_DIR"),
        "import_torch_s": round(IMPORT_S, 3), "build_s": round(build_s, 3), "first": first,
        "second_call_s": round(second_call_s, 3), "warm_call_s": round(warm_call_s, 3),
        "decode_compiles": backend.num_compiles, "captures": backend.num_captures,
        "torch_compile": compile_report(),
    }
    if profiler:
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(60)
        with open(args.profile, "w") as handle:
            handle.write(text.getvalue())
        record["profile"] = args.profile
    record = with_provenance(record)
    line = json.dumps(record)
    print(line)
    if args.out:
        with open(args.out, "a") as handle:
            handle.write(line + "\n")
    return 0


def timed_call(backend, model, prompts, call) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    backend.generate(model, prompts, **call)
    torch.cuda.synchronize()
    return time.perf_counter() - start


if __name__ == "__main__":
    sys.exit(main())
