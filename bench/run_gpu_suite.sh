#!/usr/bin/env bash
# One-GPU benchmark suite, run from the repository root on a CUDA machine; JSON lines go to $RESULTS.
#   RESULTS=bench/results/raw bash bench/run_gpu_suite.sh [logprobs] [step] [rollout]
set -u
RESULTS=${RESULTS:-bench/results/raw}
mkdir -p "$RESULTS"
export PYTHONUNBUFFERED=1
parts=${*:-logprobs step rollout}
for part in $parts; do
  case $part in
    logprobs)  # chunked_logprobs vs full logits vs TRL's fused head, fwd+bwd, bf16
      python3 bench/logprobs.py --hidden 896 1536 --tokens 8192 32768 65536 | tee -a "$RESULTS/logprobs.jsonl" ;;
    step)  # whole GRPO step, 0.5B shape, 32 completions x 512 tokens per rollout, TRL default beside hf_grpo
      for impl in trl hf_grpo; do
        python3 bench/grpo_step.py --impl "$impl" --shape 0.5b --out "$RESULTS/grpo_step.jsonl" 2>&1 | grep RESULT
      done ;;
    rollout)  # generation tokens/s: TRL default, hf, cuda_graph
      python3 bench/rollout.py --out "$RESULTS/rollout.json" ;;
  esac
done
