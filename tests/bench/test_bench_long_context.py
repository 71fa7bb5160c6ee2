"""bench/long_context.py: a decode step against the time to read the weights and the filled caches once."""

from types import SimpleNamespace

from tests.project_files import ROOT, load_file


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


def test_the_climb_doubles_until_a_length_does_not_fit_and_writes_a_row_per_length(tmp_path, monkeypatch):
    import json

    long_context = load_file(ROOT / "bench" / "long_context.py", "bench_long_context")
    tried = []

    def run_length(args, impl, length):  # stands in for a whole run: 32 tokens is one too many
        tried.append((impl, length))
        record = {"bench": "long_context", "impl": impl, "completion_len": length}
        if length >= 32:
            return {**record, "fits": False, "why": "out of memory"}
        return {**record, "fits": True, "step_s": 1.0, "run": {}}

    monkeypatch.setattr(long_context, "run_length", run_length)
    out = tmp_path / "rows.jsonl"
    long_context.main(["--device", "cpu", "--shape", "tiny", "--num_generations", "2", "--double_from", "8",
                       "--up_to", "128", "--trl", "--out", str(out)])
    assert tried == [("hf_grpo", 8), ("trl", 8), ("hf_grpo", 16), ("trl", 16), ("hf_grpo", 32)]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r.get("impl"), r.get("completion_len"), r.get("fits")) for r in rows[:-1]] == [
        ("hf_grpo", 8, True), ("trl", 8, True), ("hf_grpo", 16, True), ("trl", 16, True), ("hf_grpo", 32, False)]
    assert rows[-1]["summary"] and rows[-1]["longest_fitting"] == 16 and rows[-1]["lengths_tried"] == [8, 16, 32]
    assert all("commit" in r for r in rows)  # provenance on every row
    assert long_context.ladder(16384, 131072) == [16384, 32768, 65536, 131072]


def test_the_summary_carries_the_estimate_of_the_longest_completion_for_the_shape():
    from hf_grpo.memory import context_fit
    from hf_grpo.recipe_support.tiny import SHAPES

    long_context = load_file(ROOT / "bench" / "long_context.py", "bench_long_context")
    args = SimpleNamespace(shape="7b", num_generations=8, max_prompt=320, lora_r=16, device="cuda")
    h100 = int(79.19 * 2**30)
    dims = context_fit.ModelDims.from_config({**SHAPES["7b"], "model_type": "qwen2"})
    shape = context_fit.RunShape(prompt=320, generation_rows=8, lora_rank=16, checkpointing=True)
    assert long_context.estimated_longest(args, h100) == context_fit.longest_completion(dims, shape, h100) > 65536
