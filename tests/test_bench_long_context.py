"""bench/long_context.py: a decode step against the time to read the weights and the filled caches once."""

from types import SimpleNamespace

from project_files import ROOT, load_file


def test_a_decode_step_is_the_last_rollouts_time_over_its_longest_completion_and_the_floor_reads_7b_weights():
    long_context = load_file(ROOT / "bench" / "long_context.py", "bench_long_context")
    args = SimpleNamespace(shape="7b", num_generations=8, min_prompt=192, max_prompt=320)
    # rows that sampled their end early leave fewer tokens (1,088 a second) but as many decode steps
    run = {"generation_s": [141.155, 129.913], "rollout_max_len": [20480, 20480]}
    record = {"completion_len": 20480, "decode_tokens_per_s": 1088.4, "run": run}
    floor = long_context.decode_floor(record, args, bandwidth=4.3e12)
    assert floor["decode_step_ms"] == round(1e3 * 129.913 / 20480, 3)  # the later step's rollout
    assert floor["weights_gb"] == 15.23  # Qwen2.5-7B's 7.62B parameters in bf16
    # 8 rows, each on average its prompt (256) and half its completion, 28 layers x (keys, values) x 4 heads x 128, bf16
    assert floor["mean_cache_gb"] == round(8 * (256 + 10240) * 28 * 2 * 4 * 128 * 2 / 1e9, 2)
    assert abs(floor["decode_floor_ms"] - (floor["weights_gb"] + floor["mean_cache_gb"]) / 4.3) < 0.01
    assert floor["decode_step_over_floor"] == round(1e3 * 129.913 / 20480 / floor["decode_floor_ms"], 3)
