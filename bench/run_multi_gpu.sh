#!/usr/bin/env bash
# Quickstart with a 0.5B-shaped model: one GPU, then 2 GPUs under DDP, ZeRO-2 and ZeRO-3.
# Run from the repository root on a 2-GPU machine; per-rank performance.json files go to $RESULTS.
#   RESULTS=bench/results/raw bash bench/run_multi_gpu.sh
# CONFIGS picks the launch configs (default single_gpu multi_gpu zero2 zero3) from CONFIG_DIR (accelerate_configs).
# STEPS sets the steps (default 5), EXTRA adds recipe flags, TAG suffixes the result names (to compare settings).
set -u
RESULTS=${RESULTS:-bench/results/raw}
mkdir -p "$RESULTS"
export PYTHONUNBUFFERED=1
ARGS="--tiny_shape 0.5b --max_steps ${STEPS:-5} --max_completion_length 128 --per_device_train_batch_size 16
      --num_generations 8 --logging_steps 1 --save_strategy no --disable_tqdm true ${EXTRA:-}"
for config in ${CONFIGS:-single_gpu multi_gpu zero2 zero3}; do
  processes=2; [ "$config" = single_gpu ] && processes=1
  name=$config${TAG:+_$TAG}
  out=/tmp/multi_gpu_$name
  timeout 240 python3 -m accelerate.commands.launch --config_file "${CONFIG_DIR:-accelerate_configs}/$config.yaml" --num_processes $processes \
    recipes/quickstart.py $ARGS --output_dir "$out" > "$RESULTS/multi_gpu_$name.log" 2>&1
  echo "$name exit=$?"
  cp "$out/performance.json" "$RESULTS/multi_gpu_$name.json" 2>/dev/null
  cp "$out/metrics.jsonl" "$RESULTS/multi_gpu_${name}_metrics.jsonl" 2>/dev/null
  python3 - "$name" "$out/performance.json" "$out/metrics.jsonl" <<'PY'
import json, statistics, sys
try:
    ranks = json.load(open(sys.argv[2]))["per_rank"]
except OSError:
    sys.exit(0)
print(sys.argv[1], [dict(step_s=round(r["step_s"], 3), peak_gib=round(r["peak_memory_gib"], 2),
                         gen_s=round(r["generation_s_per_step"], 3)) for r in ranks])
try:  # steady state: the logged steps after the first (which compiles and captures)
    rows = [json.loads(line) for line in open(sys.argv[3])]
    steps = [r["perf/step_s"] for r in rows if "perf/step_s" in r][1:]
    gens = [r["perf/generation_s_per_step"] for r in rows if "perf/generation_s_per_step" in r][1:]
    print(sys.argv[1], "steady step_s median", round(statistics.median(steps), 3),
          "generation_s median", round(statistics.median(gens), 3) if gens else None)
except (OSError, KeyError, statistics.StatisticsError) as err:
    print(sys.argv[1], "no steady figures:", err)
PY
done
