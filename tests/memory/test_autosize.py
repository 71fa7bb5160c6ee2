""""auto" batch sizes (hf_grpo.memory.autosize): CPU defaults, validation, the search, probing, saving and resuming."""

import dataclasses
import json
import logging

import pytest
import torch
from tests.test_trainer import make_trainer, train_one_step

import hf_grpo.batch_fields
import hf_grpo.config
import hf_grpo.logprob_head
from hf_grpo.memory import autosize
from hf_grpo.memory.autosize import (
    AUTO_DEFAULTS,
    SIZES_FILE,
    largest_fitting,
    train_batch_candidates,
)

AUTO_FIELDS = ["per_device_train_batch_size", "per_device_generation_batch_size", "tensor_batch_size"]


@pytest.mark.parametrize("field", AUTO_FIELDS)
def test_auto_on_cpu_is_the_documented_default_without_probing(make_config, field):
    config = make_config(num_generations=4, gradient_accumulation_steps=3, **{field: "auto"})
    assert config.auto_batch_fields == ()
    assert config.per_device_train_batch_size == 8 and config.gradient_accumulation_steps == 3
    assert config.tensor_batch_size == AUTO_DEFAULTS["tensor_batch_size"] == 1024
    assert config.per_device_generation_batch_size == 8 * 3  # None: the whole per-device rollout, P x S
    assert "auto" not in str(config.batch_plan())


@pytest.mark.parametrize("variable", ["DIFFU_BATCH_SIZE", "DIFFU_TRAIN_BATCH_SIZE", "DIFFU_TENSOR_BATCH_SIZE"])
def test_env_variables_may_say_auto(make_config, monkeypatch, variable):
    monkeypatch.setenv(variable, "AUTO")
    config = make_config(per_device_train_batch_size=4, num_generations=4, tensor_batch_size=64,
                         per_device_generation_batch_size=2)
    field = hf_grpo.config.ENV_OVERRIDES[variable]
    assert getattr(config, field) == {"per_device_generation_batch_size": 4, "per_device_train_batch_size": 8,
                                      "tensor_batch_size": 1024}[field]


def test_on_cuda_auto_fields_stay_listed_and_the_plan_says_so(make_config, monkeypatch):
    monkeypatch.setattr(hf_grpo.batch_fields, "_cuda_available", lambda: True)
    config = make_config(num_generations=4, per_device_train_batch_size="auto", tensor_batch_size="auto")
    assert config.auto_batch_fields == ("per_device_train_batch_size", "tensor_batch_size")
    assert config.per_device_train_batch_size == 8  # provisional, for TRL's own checks
    assert "auto: per_device_train_batch_size, tensor_batch_size chosen at train start" in str(config.batch_plan())


@pytest.mark.parametrize("field", AUTO_FIELDS)
@pytest.mark.parametrize("value", ["autox", "4x", 2.5, True, ""])
def test_bad_values_name_the_field_and_what_is_valid(make_config, field, value):
    sizes = dict(num_generations=4, per_device_train_batch_size=4)
    sizes[field] = value
    with pytest.raises(ValueError) as err:
        make_config(**sizes)
    assert f"{field} must be a positive integer or 'auto'" in str(err.value)
    assert repr(value) in str(err.value)


@pytest.mark.parametrize("field", AUTO_FIELDS)
@pytest.mark.parametrize("value", [0, -2, "0", "-2"])
def test_sizes_below_one_are_rejected_naming_the_field(make_config, field, value):
    sizes = dict(num_generations=4, per_device_train_batch_size=4)
    sizes[field] = value
    with pytest.raises(ValueError, match=rf"{field} must be an integer >= 1.*got {int(value)}"):
        make_config(**sizes)


def test_text_values_from_the_command_line_are_read_as_sizes(make_config):
    config = make_config(num_generations=4, per_device_train_batch_size="4", per_device_generation_batch_size="2",
                         tensor_batch_size="None")
    assert (config.per_device_train_batch_size, config.per_device_generation_batch_size) == (4, 2)
    assert config.tensor_batch_size is None
    with pytest.raises(ValueError, match=r"per_device_train_batch_size must be a positive integer or 'auto', got None"):
        make_config(num_generations=4, per_device_train_batch_size=None)


def test_command_line_flags_may_say_auto():
    from transformers import HfArgumentParser

    from hf_grpo import GRPOConfig

    flags = ["--output_dir", "unused", "--use_cpu", "true", "--bf16", "false", "--report_to", "none",
             "--num_generations", "4", "--per_device_train_batch_size", "auto", "--tensor_batch_size", "none",
             "--per_device_generation_batch_size", "4"]
    (config,) = HfArgumentParser(GRPOConfig).parse_args_into_dataclasses(flags)
    assert (config.per_device_train_batch_size, config.per_device_generation_batch_size) == (8, 4)
    assert config.tensor_batch_size is None


def test_bad_env_auto_spelling_names_the_variable(make_config, monkeypatch):
    monkeypatch.setenv("DIFFU_TENSOR_BATCH_SIZE", "autox")
    with pytest.raises(ValueError, match=r"DIFFU_TENSOR_BATCH_SIZE='autox' is not a positive integer or 'auto'"):
        make_config(num_generations=4)


@pytest.mark.parametrize("fraction", [0, 1.5, -0.1, "high"])
def test_auto_memory_fraction_must_lie_in_0_1(make_config, fraction):
    with pytest.raises(ValueError, match=rf"auto_memory_fraction must be a number in \(0, 1\].*got {fraction!r}"):
        make_config(num_generations=4, auto_memory_fraction=fraction)


# ---- the search -------------------------------------------------------------------------------
@pytest.mark.parametrize("threshold", [1, 2, 37, 63, 64])
def test_largest_fitting_finds_the_threshold_in_few_tries(threshold):
    candidates = list(range(1, 65))
    best, tried = largest_fitting(candidates, lambda size: size <= threshold)
    assert best == threshold
    assert len(tried) <= 2 * 7  # doubling, then bisection: logarithmic in the 64 candidates
    assert all(ok == (size <= threshold) for size, ok in tried)


def test_largest_fitting_returns_the_smallest_when_nothing_fits():
    assert largest_fitting([2, 4, 8], lambda size: False) == (2, [(2, False)])


def test_train_batch_candidates_keep_whole_steps_and_rollouts():
    assert train_batch_candidates(8 * 2, 8 * 4) == [1, 2, 4, 8, 16]
    assert train_batch_candidates(8 * 3, 8 * 3) == [1, 2, 3, 4, 6, 8, 12, 24]


# ---- probing on the real (tiny) model, with out-of-memory injected by size -----------------------
def fake_cuda_probe(monkeypatch):
    """Probes run their real units on CPU; a unit 'fits' unless it raised an (injected) out-of-memory."""
    def fits(cap, device, unit):
        try:
            unit()
            return True
        except torch.OutOfMemoryError:
            return False

    monkeypatch.setattr(hf_grpo.batch_fields, "_cuda_available", lambda: True)
    monkeypatch.setattr(autosize, "memory_cap_bytes", lambda device, fraction: 1 << 40)
    monkeypatch.setattr(autosize, "fits_under", fits)


def test_probe_picks_the_largest_fitting_sizes_and_trains_as_if_they_were_set(tmp_path, monkeypatch):
    fake_cuda_probe(monkeypatch)
    trainer = make_trainer(tmp_path / "auto", fixed=True, per_device_train_batch_size="auto",
                           per_device_generation_batch_size="auto", tensor_batch_size="auto",
                           gradient_accumulation_steps=2, num_generations=4)
    generate, forward_rows = trainer.model.generate, []

    def small_generate(*args, **kwargs):  # more than 4 sequences at once "runs out of memory"
        if kwargs["input_ids"].size(0) > 4:
            raise torch.OutOfMemoryError("injected")
        return generate(*args, **kwargs)

    real_head = hf_grpo.logprob_head.chunked_logprobs

    def small_train(hidden, *args, chunk_rows, **kwargs):  # more than 4 sequences per micro-batch does too
        forward_rows.append(hidden.shape[0])
        if hidden.shape[0] > 4 * trainer.max_completion_length:  # scored rows: the completion part
            raise torch.OutOfMemoryError("injected")
        return real_head(hidden, *args, chunk_rows=chunk_rows, **kwargs)

    trainer.model.generate = small_generate
    monkeypatch.setattr(hf_grpo.logprob_head, "chunked_logprobs", small_train)
    trainer.decisions.backend = None  # the probe generates with the run's real backend
    chosen = trainer._settle_sizes(None)  # as train start does
    assert chosen == {"per_device_train_batch_size": 4, "per_device_generation_batch_size": 4,
                      "tensor_batch_size": 256, "gradient_accumulation_steps": 4, "steps_per_generation": 4}
    assert trainer.args.auto_batch_fields == ()
    assert all(not k.backoffs for k in trainer._oom_knobs.values())  # probe failures are not run back-offs
    monkeypatch.setattr(hf_grpo.logprob_head, "chunked_logprobs", real_head)
    trainer.model.generate = generate

    from tests.test_trainer import FixedBackend

    trainer.decisions.backend = FixedBackend()
    got = train_one_step(trainer)
    explicit = make_trainer(tmp_path / "explicit", per_device_train_batch_size=4, gradient_accumulation_steps=4,
                            per_device_generation_batch_size=4, tensor_batch_size=256, num_generations=4)
    expected = train_one_step(explicit)
    assert got[0] == expected[0]
    assert all(torch.equal(got[1][name], expected[1][name]) for name in got[1])


# ---- saving and resuming ------------------------------------------------------------------------
def head_out_of_memory_above(monkeypatch, rows: int):
    """The LM head runs out of memory on chunks of more than ``rows`` rows; returns the real head."""
    real = hf_grpo.logprob_head.chunked_logprobs

    def failing(hidden, *args, chunk_rows, **kwargs):
        if chunk_rows > rows:
            raise torch.OutOfMemoryError("injected")
        return real(hidden, *args, chunk_rows=chunk_rows, **kwargs)

    monkeypatch.setattr(hf_grpo.logprob_head, "chunked_logprobs", failing)
    return real


def test_checkpoints_hold_the_sizes_and_a_resume_reads_them_instead_of_probing(tmp_path, monkeypatch):
    real = head_out_of_memory_above(monkeypatch, 8)
    first = make_trainer(tmp_path, tensor_batch_size=32, save_strategy="steps", save_steps=1)
    first.train()
    checkpoint = tmp_path / "out" / "checkpoint-1"
    saved = json.loads((checkpoint / SIZES_FILE).read_text())
    assert saved == {"per_device_train_batch_size": 8, "per_device_generation_batch_size": 8, "tensor_batch_size": 8,
                     "gradient_accumulation_steps": 1, "steps_per_generation": 1, "max_tokens_per_micro_batch": None,
                     # where each chunk size started (tensor_batch_size=32, halved twice) and what they are for
                     "configured": {"per_device_generation_batch_size": 8, "tensor_batch_size": 32,
                                    "max_tokens_per_micro_batch": None},
                     "chosen_for": {"per_device_batch_per_optimizer_step": 8, "per_device_rollout": 8,
                                    "max_completion_length": 6}}
    monkeypatch.setattr(hf_grpo.logprob_head, "chunked_logprobs", real)

    # As a probe on a GPU would have chosen: micro-batches of 4, twice as many of them.
    saved.update(per_device_train_batch_size=4, gradient_accumulation_steps=2, steps_per_generation=2)
    (checkpoint / SIZES_FILE).write_text(json.dumps(saved))
    fake_cuda_probe(monkeypatch)
    monkeypatch.setattr(autosize, "Prober", lambda *a: pytest.fail("a resume must not probe again"))
    resumed = make_trainer(tmp_path, tensor_batch_size=32, per_device_train_batch_size="auto", max_steps=2,
                           save_strategy="steps", save_steps=1)
    assert resumed.args.auto_batch_fields == ("per_device_train_batch_size",)
    resumed.train(resume_from_checkpoint=True)
    args = resumed.args
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps, args.steps_per_generation) == (4, 2, 2)
    assert args.tensor_batch_size == 8  # the back-off of the first run is kept
    assert resumed.state.global_step == 2
    assert json.loads((tmp_path / "out" / "checkpoint-2" / SIZES_FILE).read_text()) == saved


def test_a_model_only_checkpoint_holds_the_sizes_too(tmp_path):
    # save_only_model saves no random state, so the sizes come from the on_save callback instead
    make_trainer(tmp_path, save_strategy="steps", save_steps=1, save_only_model=True).train()
    checkpoint = tmp_path / "out" / "checkpoint-1"
    assert not list(checkpoint.glob("rng_state*.pth"))
    assert json.loads((checkpoint / SIZES_FILE).read_text())["tensor_batch_size"] is not None


def recording_chunks(trainer):
    """The chunk sizes the trainer's generation backend is called with."""
    chunks, generate = [], trainer.decisions.backend.generate

    def record(model, prompt_ids, **kwargs):
        chunks.append(kwargs["chunk_size"])
        return generate(model, prompt_ids, **kwargs)

    trainer.decisions.backend.generate = record
    return chunks


@pytest.mark.parametrize("file_format", ["current", "without where the sizes came from"])
def test_a_resume_with_a_larger_batch_generates_its_rollout_in_one_chunk(tmp_path, caplog, file_format):
    # per_device_generation_batch_size unset: the whole per-device rollout, 8 in the first run, 16 in the resumed one
    make_trainer(tmp_path, save_strategy="steps", save_steps=1).train()
    sizes = tmp_path / "out" / "checkpoint-1" / SIZES_FILE
    if file_format != "current":  # as checkpoints saved before "configured" and "chosen_for" were written hold it
        saved = json.loads(sizes.read_text())
        sizes.write_text(json.dumps({k: v for k, v in saved.items() if k not in ("configured", "chosen_for")}))
    resumed = make_trainer(tmp_path, per_device_train_batch_size=16, max_steps=2, save_strategy="steps", save_steps=1)
    chunks = recording_chunks(resumed)
    with caplog.at_level(logging.INFO, logger="hf_grpo"):
        resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 2
    assert resumed.args.per_device_generation_batch_size == 16 and chunks == [16]  # one chunk, not two of 8
    assert "auto batch sizes" not in caplog.text and "kept from" not in caplog.text
    if file_format != "current":
        assert "per_device_generation_batch_size=8 (set for another batch: per_device_batch_per_optimizer_step 8 " \
               "then, 16 now, per_device_rollout 8 then, 16 now)" in caplog.text


def test_a_back_off_is_kept_where_this_run_starts_the_chunk_from_the_same_size(tmp_path, monkeypatch, caplog):
    real = head_out_of_memory_above(monkeypatch, 16)
    make_trainer(tmp_path, tensor_batch_size=32, save_strategy="steps", save_steps=1).train()  # halved to 16
    monkeypatch.setattr(hf_grpo.logprob_head, "chunked_logprobs", real)
    same = make_trainer(tmp_path, tensor_batch_size=32, per_device_train_batch_size=16, max_steps=2,
                        save_strategy="steps", save_steps=1)
    with caplog.at_level(logging.INFO, logger="hf_grpo"):
        same.train(resume_from_checkpoint=True)
    assert same.args.tensor_batch_size == 16
    assert "tensor_batch_size=16 kept from" in caplog.text and "lowered it from 32 after an out-of-memory" in caplog.text
    caplog.clear()
    changed = make_trainer(tmp_path, tensor_batch_size=64, max_steps=3, save_strategy="steps", save_steps=1)
    with caplog.at_level(logging.INFO, logger="hf_grpo"):
        changed.train(resume_from_checkpoint=True)
    assert changed.args.tensor_batch_size == 64  # the user changed the size the back-off started from
    assert "tensor_batch_size=16 (lowered after an out-of-memory from 32; this run starts from 64)" in caplog.text


def test_a_back_off_is_kept_under_deepspeed_too(tmp_path, monkeypatch):
    """A chunk an out-of-memory lowered changes no engine's batch: a resume under DeepSpeed keeps it (only "auto"
    sizes, which would need a probe of the bare model, are refused there)."""
    head_out_of_memory_above(monkeypatch, 16)
    make_trainer(tmp_path, tensor_batch_size=32, save_strategy="steps", save_steps=1).train()  # halved to 16
    resumed = make_trainer(tmp_path, tensor_batch_size=32, max_steps=2)
    resumed.facts = dataclasses.replace(resumed.facts, deepspeed=True)  # as the trainer finds a DeepSpeed launch
    resumed._settle_sizes(str(tmp_path / "out" / "checkpoint-1"))
    assert resumed.sizes.tensor_batch_size == resumed.args.tensor_batch_size == 16


def test_auto_sizes_chosen_for_another_batch_are_probed_again(tmp_path, monkeypatch, caplog):
    make_trainer(tmp_path, save_strategy="steps", save_steps=1).train()  # per-device batch per step 8
    checkpoint = str(tmp_path / "out" / "checkpoint-1")
    fake_cuda_probe(monkeypatch)
    probed = []

    class CountingProber(autosize.Prober):
        def search(self, name):
            probed.append(name)
            return super().search(name)

    monkeypatch.setattr(autosize, "Prober", CountingProber)
    same = make_trainer(tmp_path / "same", per_device_train_batch_size="auto")
    assert same._settle_sizes(checkpoint) == {
        "per_device_train_batch_size": 8, "gradient_accumulation_steps": 1, "steps_per_generation": 1}
    assert probed == []  # chosen for this batch: read, not probed
    doubled = make_trainer(tmp_path / "doubled", per_device_train_batch_size="auto", gradient_accumulation_steps=2)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="hf_grpo"):
        doubled._settle_sizes(checkpoint)
    assert probed == ["per_device_train_batch_size"]
    assert "per_device_train_batch_size=8 ('auto' chosen for another batch: per_device_batch_per_optimizer_step 8 " \
           "then, 16 now, per_device_rollout 8 then, 16 now)" in caplog.text
    assert "auto batch sizes (probed under" in caplog.text and "auto batch sizes (read from" not in caplog.text
