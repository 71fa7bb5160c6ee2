"""bench/scoring_switches.py: TRL's switches for one rollout, the libraries' own and the trainer's quick ones, timed
on the same model in one row (no speed is asserted here: that is the benchmark's to print)."""

import json

from tests.project_files import ROOT, load_file

bench = load_file(ROOT / "bench" / "scoring_switches.py", "scoring_switches_bench")


def test_one_row_with_both_switches_timed_and_where_it_ran(tmp_path, capsys):
    out = tmp_path / "rows.jsonl"
    assert bench.main(["--layers", "2", "--lora_r", "2", "--repeats", "2", "--out", str(out)]) == 0
    row = json.loads(out.read_text())
    assert row == json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert row["bench"] == "scoring_switches" and row["layers"] == 2 and row["lora_r"] == 2
    assert row["modules"] > 2 * 7  # the decoder layers' LoRA layers and their adapters
    assert all(row[key] > 0 for key in ("own_ms", "quick_ms", "own_again_ms"))
    assert {"commit", "gpu", "torch", "transformers", "trl", "peft", "cpu"} <= row.keys()


def test_the_sequence_switches_a_lora_reference_and_leaves_the_model_as_it_was():
    model = bench.build(2, 2)
    flags = [getattr(m, "gradient_checkpointing", None) for m in model.modules()]
    for quick in (False, True):
        bench.timed(model, lora=True, quick=quick, repeats=1)
        assert [getattr(m, "gradient_checkpointing", None) for m in model.modules()] == flags
        assert not any(layer.disable_adapters for layer in model.base_model.model.model.layers[0].mlp.modules()
                       if hasattr(layer, "disable_adapters"))
