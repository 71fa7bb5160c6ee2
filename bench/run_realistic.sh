#!/usr/bin/env bash
# Realistic whole-run GRPO benchmark (bench/grpo_realistic.py) on one GPU, from the repository root:
# TRL's default trainer and TRL with continuous batching, then hf_grpo with the hf and cuda_graph backends, each in
# its own process (peak memory does not mix), then optionally hf_grpo/hf with small chunks to show memory falling.
#
#   bash bench/run_realistic.sh
#   STEPS=10 SHAPE=0.5b IMPLS="trl hf cuda_graph hf_small" RESULTS=bench/results/raw bash bench/run_realistic.sh
#
# Env: STEPS (10), SHAPE (0.5b | 1.5b), IMPLS (runs, from: trl trl_cb trl_nocudnn hf cuda_graph padded_graphs
# eager_training sampler_logprobs compiled_decode no_shape_reuse hf_small; default trl trl_cb hf cuda_graph hf_small;
# trl_cb is TRL with use_transformers_continuous_batching=True; trl_nocudnn is TRL with cuDNN's SDPA kernel off, as
# hf_grpo has it;
# padded_graphs is cuda_graph with the replayed micro-batches' rows padded, not packed (padding_free=False);
# eager_training is cuda_graph with the training micro-batches run eagerly, training_cuda_graphs=off;
# sampler_logprobs is cuda_graph with the sampler's log-probs standing for the old policy's (old_logprobs_source);
# compiled_decode is cuda_graph with the decode step compiled whatever the run's length (compile_generation=on);
# no_shape_reuse is cuda_graph with every new packed shape captured at its first micro-batch),
# RESULTS (default $OUT if set, else bench/results/raw), RUN_TIMEOUT (hard limit per run, s, default 280),
# COMPILE_CACHE (torch's compile cache for every run; default: a fresh empty one per run, so each run
# compiles cold as a first run on a new machine does, whatever ran before it),
# MAX_SECONDS (each run stops training after the step that passes this many seconds, default 150, so a
# slow run still writes its record), EXTRA (more flags for every run), PYTHON (default python3).
# A run takes about RUN_TIMEOUT at most (start-up ~30-60 s + up to MAX_SECONDS of training + the step
# in progress); where one command may run 10 minutes, run two at a time:
#   IMPLS="trl hf" bash bench/run_realistic.sh;  IMPLS="cuda_graph hf_small" bash bench/run_realistic.sh
# JSON lines are appended to $RESULTS/grpo_realistic.jsonl; a table of this call's runs ends the output.
set -u
export PYTHONUNBUFFERED=1
STEPS=${STEPS:-10}
SHAPE=${SHAPE:-0.5b}
IMPLS=${IMPLS:-trl trl_cb hf cuda_graph hf_small}
RESULTS=${RESULTS:-${OUT:-bench/results/raw}}
RUN_TIMEOUT=${RUN_TIMEOUT:-280}
MAX_SECONDS=${MAX_SECONDS:-150}
EXTRA=${EXTRA:-}
mkdir -p "$RESULTS"
JSONL="$RESULTS/grpo_realistic.jsonl"
THIS_CALL=$(mktemp)
PY=${PYTHON:-python3}

$PY - <<'EOF'
import importlib
for name in ("torch", "transformers", "trl", "datasets", "accelerate", "pyarrow", "fsspec", "huggingface_hub"):
    try:
        print(f"{name} {importlib.import_module(name).__version__}", end="; ")
    except Exception as err:  # noqa: BLE001
        print(f"{name} MISSING ({type(err).__name__}: {err})", end="; ")
import sys
if sys.flags.dont_write_bytecode and not sys.pycache_prefix:
    print("\nnote: this Python writes no bytecode (PYTHONDONTWRITEBYTECODE): every run compiles torch's sources as it "
          "imports them, seconds of its first step that a pip install does not pay; see bench/README.md", flush=True)
try:
    import torch
    print("gpu:", torch.cuda.get_device_name() if torch.cuda.is_available() else None, flush=True)
except Exception as err:  # noqa: BLE001
    print("gpu: ?", err, flush=True)
EOF

for run in $IMPLS; do
  case $run in
    trl)        flags="--impl trl" ;;
    trl_cb)     flags="--impl trl --trl_continuous_batching" ;;
    trl_nocudnn) flags="--impl trl --cudnn_attention off" ;;
    hf)         flags="--impl hf_grpo --backend hf" ;;
    cuda_graph) flags="--impl hf_grpo --backend cuda_graph" ;;
    padded_graphs) flags="--impl hf_grpo --backend cuda_graph --padding_free off" ;;
    eager_training) flags="--impl hf_grpo --backend cuda_graph --training_cuda_graphs off" ;;
    sampler_logprobs) flags="--impl hf_grpo --backend cuda_graph --old_logprobs_source sampler" ;;
    compiled_decode) flags="--impl hf_grpo --backend cuda_graph --compile_generation on" ;;
    no_shape_reuse) flags="--impl hf_grpo --backend cuda_graph --shape_reuse_capture_cost 0" ;;
    hf_small)   flags="--impl hf_grpo --backend hf --tensor_batch_size 256 --per_device_generation_batch_size 8" ;;
    *) echo "unknown run $run (from: trl trl_cb trl_nocudnn hf cuda_graph padded_graphs eager_training" \
            "sampler_logprobs compiled_decode no_shape_reuse hf_small)"; continue ;;
  esac
  echo "=== $run: $flags --shape $SHAPE --max_steps $STEPS"
  start=$(date +%s)
  cache=${COMPILE_CACHE:-$(mktemp -d)}
  # shellcheck disable=SC2086
  TORCHINDUCTOR_CACHE_DIR=$cache timeout -k 10 "$RUN_TIMEOUT" $PY bench/grpo_realistic.py $flags --shape "$SHAPE" \
      --max_steps "$STEPS" --max_seconds "$MAX_SECONDS" --out "$JSONL" $EXTRA > >(tee "$THIS_CALL.log" | grep "^RESULT" | cut -c1-400) 2>&1
  rc=$?
  echo "=== $run: exit $rc after $(( $(date +%s) - start )) s"
  sleep 1
  grep "^RESULT " "$THIS_CALL.log" | sed 's/^RESULT //' >> "$THIS_CALL"
  if [ "$rc" -ne 0 ]; then tail -n 25 "$THIS_CALL.log"; fi
done

$PY - "$THIS_CALL" <<'EOF'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
print(f"\n{'impl':8} {'backend':10} {'chunks':9} {'steps':5} {'total s':>7} {'gen s':>6} {'peak GiB':>8} {'resv GiB':>8} {'wts GiB':>7} {'len':>6}  step s | generation s | mean len/step")
for r in rows:
    chunks = f"{r.get('tensor_batch_size') or '-'}/{r.get('per_device_generation_batch_size') or '-'}"
    print(f"{r['impl']:8} {r['backend']:10} {chunks:9} {r['steps_done']:5} {r['train_s']:7.1f} {r['generation_s_total']:6.1f} "
          f"{r.get('peak_mem_gib', 0):8.2f} {r.get('peak_reserved_gib', 0):8.2f} {r.get('weights_gib', 0):7.2f} "
          f"{r['completion_len_mean_overall']:6.1f}  {r['step_s']} | {r['generation_s']} | {r['completion_len_mean']}")
print(f"({len(rows)} runs; chunks = tensor_batch_size/per_device_generation_batch_size; gpu {rows[0].get('gpu') if rows else None})")
EOF
rm -f "$THIS_CALL" "$THIS_CALL.log"
