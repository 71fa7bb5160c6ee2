#!/usr/bin/env bash
# The realistic run (bench/grpo_realistic.py) launched as users launch it: `accelerate launch --config_file
# accelerate_configs/<config>.yaml --num_processes N`, TRL's trainer under the same config, each run in its own
# launch under a hard time limit. The 1.5B + LoRA r16 run of bench/README.md: prompts 64-1024 tokens, completions of
# up to 512, activation checkpointing (TRL's default), 6 steps, every step split by phase on every rank, peak memory
# per rank. From the repository root:
#
#   bash bench/run_launch_configs.sh                         # GPU: CONFIGS x IMPLS, one process on one GPU
#   IMPLS="hf_grpo_padded hf_grpo_packed" bash bench/run_launch_configs.sh   # packed against padded under DeepSpeed
#   bash bench/run_launch_configs.sh --tiny                  # CPU smoke: tiny model, 2 steps, same launches
#   CONFIGS="multi_gpu zero2" PROCESS_COUNTS="1 2 4 8" bash bench/run_launch_configs.sh   # scaling on one host
#   SHAPE=7b-lora CONFIGS=zero2 bash bench/run_launch_configs.sh                          # 7B LoRA, 2048 tokens
#   SHAPE=7b-full CONFIGS=zero3 PROCESS_COUNTS="4 8" bash bench/run_launch_configs.sh     # 7B full fine-tune
#
# Env: CONFIGS (default "zero2 zero3"; any accelerate_configs/<name>.yaml), IMPLS (default "trl trl_cb hf_grpo";
# trl_cb: TRL with use_transformers_continuous_batching=True, its no-vLLM fast path; hf_grpo_padded,
# hf_grpo_packed: hf_grpo with padding_free forced False / True), NUM_PROCESSES (1), PROCESS_COUNTS
# (the process counts to launch each config with, default NUM_PROCESSES; the summary gives completions/s per GPU
# against the smallest count), SHAPE (1.5b-lora: the run above; 7b-lora: Qwen2.5-7B's dimensions with LoRA r16,
# completions of up to 2048; 7b-full: the 7B fully fine-tuned, completions of up to 1024, generation 16 at a time;
# ZeRO-3 generates from the dense mirror), STEPS (6),
# TOTAL_SECONDS (540: the whole call, split evenly between its runs), RUN_TIMEOUT (a run's hard limit, default
# TOTAL_SECONDS / runs), STARTUP (seconds a run's launch, imports and model build may take, default 90 on a GPU),
# MAX_SECONDS (a run stops training after the step that passes this many seconds, default RUN_TIMEOUT - STARTUP,
# so that a slow run still writes its record; such a record says stopped_early), EXTRA (more grpo_realistic.py
# flags), LAUNCH_EXTRA (more `accelerate launch` flags, e.g. `--main_process_port 29600` beside another launch on
# the host), RESULTS (default $OUT if set, else bench/results/raw), PYTHON (python3). RUN_TIMEOUT_<impl> and
# STEPS_<impl> set one impl's limit and steps, e.g. RUN_TIMEOUT_trl=300 STEPS_trl=2 beside RUN_TIMEOUT_hf_grpo=170:
# a baseline bound by the host gets the call's time, the fast run its steps (its MAX_SECONDS follows its limit).
# Four runs in 540 s leave a 1.5B TRL run about a minute of training (a few steps): for all 6 steps give each run
# its own call, e.g. CONFIGS=zero2 IMPLS=trl bash bench/run_launch_configs.sh. Measured on H200s: TRL's 6 steps
# under multi_gpu.yaml with two processes took 263 s (RUN_TIMEOUT=320 STARTUP=120 leaves room); under zero3.yaml
# it did not finish in 255 s (its generate gathers every layer at each token): give it a call of its own.
# Records (one JSON line a run, rank 0's figures at the top level and every rank's under per_rank, with provenance)
# are appended to $RESULTS/launch_configs.jsonl; a run that fails or passes its limit appends a line saying so, with
# whether its training began, the steps it finished and how long its unfinished step had run when stopped
# (unfinished_step_s_at_least: read from its output, a lower bound on a slow baseline's step);
# one whose record was written before the limit came (during its shutdown) keeps that record alone. The summary
# gives each run's first step beside its later ones: a slow baseline may finish only its first in the call's time.
# Under DeepSpeed the optimizer step runs inside accelerator.backward: the phases charge it to "backward".
set -u
export PYTHONUNBUFFERED=1
TINY=0
[ "${1:-}" = "--tiny" ] && TINY=1
CONFIGS=${CONFIGS:-zero2 zero3}
IMPLS=${IMPLS:-trl trl_cb hf_grpo}
NUM_PROCESSES=${NUM_PROCESSES:-1}
PROCESS_COUNTS=${PROCESS_COUNTS:-$NUM_PROCESSES}
SHAPE=${SHAPE:-1.5b-lora}
PY=${PYTHON:-python3}
RESULTS=${RESULTS:-${OUT:-bench/results/raw}}
mkdir -p "$RESULTS"
JSONL="$RESULTS/launch_configs.jsonl"
set -- $CONFIGS; configs=$#
set -- $IMPLS; impls=$#
set -- $PROCESS_COUNTS; counts=$#
runs=$(( configs * impls * counts ))
TOTAL_SECONDS=${TOTAL_SECONDS:-540}
RUN_TIMEOUT=${RUN_TIMEOUT:-$(( TOTAL_SECONDS / (runs > 0 ? runs : 1) ))}
if [ "$TINY" = 1 ]; then
  STEPS=${STEPS:-2}
  STARTUP=${STARTUP:-60}
  SHAPE_FLAGS="--device cpu --shape tiny --lora_r 4 --min_prompt 8 --max_prompt 24 --max_completion_length 16
    --per_device_train_batch_size 4 --num_generations 4 --steps_per_generation 2 --gradient_accumulation_steps 2"
  LAUNCH_FLAGS="--mixed_precision no"  # fp32 on the CPU, whatever the config says
else
  STEPS=${STEPS:-6}
  STARTUP=${STARTUP:-90}
  case $SHAPE in
    1.5b-lora) SHAPE_FLAGS="--shape 1.5b --lora_r 16 --min_prompt 64 --max_prompt 1024 --max_completion_length 512
                 --per_device_generation_batch_size 32" ;;
    7b-lora)   SHAPE_FLAGS="--shape 7b --lora_r 16 --min_prompt 64 --max_prompt 1024 --max_completion_length 2048
                 --per_device_generation_batch_size 32" ;;
    7b-full)   SHAPE_FLAGS="--shape 7b --lora_r 0 --min_prompt 64 --max_prompt 1024 --max_completion_length 1024
                 --per_device_generation_batch_size 16" ;;
    *) echo "SHAPE must be 1.5b-lora, 7b-lora or 7b-full, got '$SHAPE'"; exit 2 ;;
  esac
  LAUNCH_FLAGS=""
fi
# The summary's later steps stand for a long run's: the decode step compiled, as compile_generation="auto" does in a
# run that decodes 4096 steps or more (a few steps here would capture it eager)
LONG_RUN="--compile_generation on"
# each phase timed (the device synchronized at its boundaries); PHASES=0 times the steps alone
PHASES_FLAG=$([ "${PHASES:-1}" = 0 ] && echo "" || echo "--phases")
# a run's --max_seconds: MAX_SECONDS where given, else what its limit leaves after the start-up
max_seconds() { echo "${MAX_SECONDS:-$(( $1 > STARTUP + 10 ? $1 - STARTUP : 10 ))}"; }
echo "$runs runs, each under $RUN_TIMEOUT s (training stops after the step past $(max_seconds "$RUN_TIMEOUT") s);" \
     "results: $JSONL"

for NUM_PROCESSES in $PROCESS_COUNTS; do
for config in $CONFIGS; do
  for impl in $IMPLS; do
    case $impl in
      trl)            flags="--impl trl" ;;
      trl_cb)         flags="--impl trl --trl_continuous_batching" ;;
      hf_grpo)        flags="--impl hf_grpo $LONG_RUN" ;;
      hf_grpo_padded) flags="--impl hf_grpo $LONG_RUN --padding_free off" ;;
      hf_grpo_packed) flags="--impl hf_grpo $LONG_RUN --padding_free on" ;;
      *) echo "unknown impl $impl (from: trl trl_cb hf_grpo hf_grpo_padded hf_grpo_packed)"; continue ;;
    esac
    label="$config x$NUM_PROCESSES, $impl"
    limit_var="RUN_TIMEOUT_$impl" steps_var="STEPS_$impl"
    run_timeout=${!limit_var:-$RUN_TIMEOUT} run_steps=${!steps_var:-$STEPS}
    run_max_seconds=$(max_seconds "$run_timeout")
    echo "=== $label: $flags"
    start=$(date +%s)
    records_before=$( [ -f "$JSONL" ] && wc -l < "$JSONL" || echo 0 )
    # shellcheck disable=SC2086
    TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) timeout -k 10 "$run_timeout" $PY -m accelerate.commands.launch \
        --config_file "accelerate_configs/$config.yaml" --num_processes "$NUM_PROCESSES" \
        $LAUNCH_FLAGS ${LAUNCH_EXTRA:-} \
        bench/grpo_realistic.py $flags $SHAPE_FLAGS --max_steps "$run_steps" --max_seconds "$run_max_seconds" $PHASES_FLAG \
        --launch_config "accelerate_configs/$config.yaml" --label "$label" --out "$JSONL" ${EXTRA:-} \
        > "$RESULTS/launch_configs_run.log" 2>&1
    rc=$? ended=$(date +%s)
    echo "=== $label: exit $rc after $(( ended - start )) s (limit $run_timeout s, $run_steps steps)"
    records_after=$( [ -f "$JSONL" ] && wc -l < "$JSONL" || echo 0 )
    if [ "$rc" -ne 0 ] && [ "$records_after" -gt "$records_before" ]; then
      # its training ended (--max_seconds) and its record is written; the limit stopped only its exit
      echo "=== $label: its record was written before exit $rc (the limit came during its shutdown)"
    elif [ "$rc" -ne 0 ]; then
      tail -n 25 "$RESULTS/launch_configs_run.log"
      # the run left no record: say so in the results, with where it came from
      $PY - "$JSONL" "$config" "$impl" "$NUM_PROCESSES" "$rc" "$run_timeout" "$RESULTS/launch_configs_run.log" "$ended" <<'EOF'
import json, sys
sys.path.insert(0, "bench")
from provenance import with_provenance
path, config, impl, processes, rc, limit, log, ended = sys.argv[1:]
timed_out = rc in ("124", "137")
# how far it got: grpo_realistic.py prints TRAIN_BEGIN, then STEP_BEGIN <n> <wall clock> before each step and
# STEP <n> <seconds> after it
lines = [line.split() for line in open(log, errors="replace") if line.startswith(("TRAIN_BEGIN", "STEP"))]
steps = [float(words[2]) for words in lines if words[0] == "STEP" and len(words) == 3]
begun = [words for words in lines if words[0] == "STEP_BEGIN" and len(words) == 3]
row = dict(bench="grpo_realistic", impl=impl, launch=dict(config=f"accelerate_configs/{config}.yaml",
           world_size=int(processes)), failed=True, exit_code=int(rc), timed_out=timed_out,
           training_began=any(words[0] == "TRAIN_BEGIN" for words in lines), step_s_done=steps,
           note=f"passed its {limit} s limit" if timed_out else "exited with an error: see the call's output")
if begun and int(begun[-1][1]) > len(steps):  # stopped inside a step: it took at least this long
    row["unfinished_step"] = int(begun[-1][1])
    row["unfinished_step_s_at_least"] = round(float(ended) - float(begun[-1][2]), 1)
with open(path, "a") as handle:
    handle.write(json.dumps(with_provenance(row)) + "\n")
EOF
    fi
  done
done
done

$PY - "$JSONL" <<'EOF'
import json, statistics, sys
nan = float("nan")
rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
# the step's floor (hf_grpo's perf figures on a GPU: the work counted, over the measured matmul rate and bandwidth)
# step 1 beside the later steps: a slow baseline may finish only its first step in the call's time
print(f"\n{'config':28} {'impl':8} {'rows':8} {'steps':>5} {'step 1 s':>8} {'later step s':>12} "
      f"{'training half s':>15} {'floor s':>7} {'matmul %':>8} {'decode bw %':>11}  peak GiB by rank")
for r in rows:
    config = (r.get("launch") or {}).get("config") or "-"
    if r.get("failed"):
        done = r.get("step_s_done") or []
        began = "" if "training_began" not in r else (
            f" (training began; {len(done)} steps done" + (f", the first in {done[0]} s)" if done else ")")
            if r["training_began"] else " (before training began)")
        if "unfinished_step_s_at_least" in r:
            began += f"; step {r['unfinished_step']} ran {r['unfinished_step_s_at_least']} s and did not end"
        print(f"{config:28} {r['impl']:8} failed: {r['note']}{began}")
        continue
    later = r["step_s"][1:]
    if r["impl"] == "trl" and r.get("backend") == "trl_continuous_batching":
        r["impl"] = "trl_cb"
    phases = r.get("phases") or {}
    half = (phases.get("median_with_rollout") or {}).get("training_half")
    first_half = half is None and bool(phases.get("per_step"))
    if first_half:  # one step only: its own training half, said so on the line
        half = phases["per_step"][0].get("training_half")
    peaks = [rank.get("peak_mem_gib") for rank in r.get("per_rank", [])]
    layout = "-" if r["impl"].startswith("trl") else (r.get("eager_rows") or "-").split(" (")[0].replace("rows ", "")
    perf = r.get("perf") or {}
    fraction = lambda key: 100 * perf[key] if key in perf else nan  # noqa: E731
    # The matmul share of the training half shown (a later step's): the run-wide figure counts step 1's compiles
    matmul = (100 * perf["training_half_floor_s"] / half if half and "training_half_floor_s" in perf
              else fraction("train_matmul_fraction"))
    first = r["step_s"][0] if r["step_s"] else nan
    print(f"{config:28} {r['impl']:8} {layout:8} {r['steps_done']:5} {first:8.2f} "
          f"{statistics.median(later) if later else nan:12.3f} {half if half is not None else nan:15.3f}"
          f" {perf.get('step_floor_s', nan):7.2f} {matmul:8.1f}"
          f" {fraction('decode_bandwidth_fraction'):11.1f}  {peaks}"
          + ("  (training half: step 1's)" if first_half else ""))
# Scaling: completions a second per GPU (each rank generates and trains its own, completions_per_step of them a
# step) over the later steps, against the fewest processes each config and impl ran with.
per_gpu = {}
for r in rows:
    later = [] if r.get("failed") else r["step_s"][1:]
    if later:
        key = ((r.get("launch") or {}).get("config") or "-", r["impl"])
        per_gpu.setdefault(key, {})[r["launch"]["world_size"]] = r["completions_per_step"] / statistics.median(later)
if any(len(by_world) > 1 for by_world in per_gpu.values()):
    print(f"\n{'config':28} {'impl':8} {'GPUs':>4} {'completions/s per GPU':>22} {'vs fewest':>9}")
    for (config, impl), by_world in per_gpu.items():
        base = by_world[min(by_world)]
        for world in sorted(by_world):
            print(f"{config:28} {impl:8} {world:4} {by_world[world]:22.2f} {by_world[world] / base:9.2f}")
print(f"({len(rows)} records in {sys.argv[1]}, this call's and any before it)")
EOF
