"""padding_free=None on eager micro-batches (hf_grpo.training.eager_packing): packed where the GPU is the bound."""

import pytest
import torch

from hf_grpo.recipe_support.tiny import build_tiny_model
from hf_grpo.run_state import RunFacts
from hf_grpo.training import eager_packing, padding_free
from tests.training.test_shared_prompts import grouped_step
from tests.test_trainer import TOKENIZER

# One decoder layer's parameters of Qwen2.5 shapes (q, k, v, o and the gated MLP; the norms' few hundred aside)
LAYER_PARAMETERS = {"0.5b": 14_912_384, "1.5b": 46_797_824, "3b": 77_078_528, "7b": 233_057_792}
# a padded micro-batch of 8 rows at the benchmarks' lengths: prompts up to 384 (0.5B run) or 1024 (1.5B run)
SHORT_ROWS, LONG_ROWS = 8 * (384 + 256), 8 * (1024 + 512)


def test_layer_parameters_counts_one_decoder_layer_of_the_model():
    with torch.device("meta"):  # the real 0.5B and 1.5B shapes, no memory
        for shape in ("0.5b", "1.5b"):
            model = build_tiny_model(TOKENIZER, shape=shape)
            norms = 2 * model.config.hidden_size  # (the table above leaves out the two norms' weights)
            assert abs(eager_packing.layer_parameters(model) - norms - LAYER_PARAMETERS[shape]) <= 2 * 1536, shape


@pytest.mark.parametrize("shape, tokens, packed", [
    ("0.5b", SHORT_ROWS, False),  # measured: packed slower (host-bound)
    ("0.5b", LONG_ROWS, False),
    ("1.5b", LONG_ROWS, False),  # measured: packed and padded equal
    ("3b", LONG_ROWS, True),
    ("7b", SHORT_ROWS, True),  # measured: bound by the GPU
    ("7b", 8 * (1024 + 4096), True),
])
def test_eager_rows_pack_where_the_gpu_is_the_bound(shape, tokens, packed):
    choice = eager_packing.choose(layer_parameters=LAYER_PARAMETERS[shape], micro_batch_tokens=tokens,
                                  device_type="cuda")
    assert choice.packed is packed
    assert ("bound by the GPU" if packed else "bound by the host") in choice.reason
    assert str(choice).startswith("rows packed" if packed else "rows padded")


def test_eager_rows_stay_padded_off_cuda_however_large():
    choice = eager_packing.choose(layer_parameters=LAYER_PARAMETERS["7b"], micro_batch_tokens=LONG_ROWS,
                                  device_type="cpu")
    assert not choice.packed and "CUDA only (device cpu)" in choice.reason


def test_empty_sizes_are_refused_by_name():
    with pytest.raises(ValueError, match="micro_batch_tokens must be positive, got 1 and 0"):
        eager_packing.choose(layer_parameters=1, micro_batch_tokens=0, device_type="cuda")


@pytest.mark.parametrize("setting, auto, packed, reason", [
    (None, False, False, "packs eager micro-batches on CUDA only (device cpu)"),  # the default on a CPU
    (None, True, True, "bound by the GPU"),  # the rule chose packing (as on a large model on CUDA)
    (False, True, False, "padding_free=False"),  # the user's word wins
    (True, False, True, "padding_free=True"),
])
def test_the_run_logs_and_applies_the_eager_layout(tmp_path, monkeypatch, caplog, setting, auto, packed, reason):
    if auto:  # as choose answers where the GPU is the bound
        monkeypatch.setattr(eager_packing, "choose", lambda **sizes: eager_packing.Choice(
            True, "padding_free=None: bound by the GPU (test)"))
    calls = []
    real = padding_free.pack_rows
    monkeypatch.setattr(padding_free, "pack_rows", lambda *a, **k: calls.append(1) or real(*a, **k))
    with caplog.at_level("INFO", logger="hf_grpo"):
        trainer, _ = grouped_step(tmp_path, monkeypatch, True, padding_free=setting)
    assert trainer.decisions.eager_rows.packed is packed and reason in trainer.decisions.eager_rows.reason
    assert f"training micro-batches: eager launches (CUDA graphs need a CUDA device (device cpu)), " \
           f"{trainer.decisions.eager_rows}" in caplog.text
    assert bool(calls) is packed  # the head packed the rows (reference and policy) or never tried
    assert (trainer.decisions.prompt_grouping == "on") is packed  # and a prompt's rows went together where they share it


def test_a_model_that_cannot_pack_stays_padded_whatever_the_rule_says(tmp_path, monkeypatch):
    monkeypatch.setattr(eager_packing, "choose", lambda **sizes: eager_packing.Choice(True, "bound by the GPU"))
    trainer, _ = grouped_step(tmp_path, monkeypatch, True, padding_free=None,
                              model=build_tiny_model(TOKENIZER, seed=0, attn_implementation="eager"))
    assert not trainer.decisions.eager_rows.packed and "attn_implementation='eager'" in trainer.decisions.eager_rows.reason


def test_a_model_on_trls_fused_head_stays_padded(tmp_path, monkeypatch):
    """Where the chunked head is not installed (a model it refuses), TRL's head scores rows padded: the log and the
    grouping must not say packed."""
    monkeypatch.setattr(eager_packing, "choose", lambda **sizes: eager_packing.Choice(True, "bound by the GPU"))
    choice = eager_packing.for_run(None, build_tiny_model(TOKENIZER, seed=0), RunFacts(), False, 8,
                                   lambda: pytest.fail("the training set was scanned"))
    assert not choice.packed and "TRL's fused head" in choice.reason
