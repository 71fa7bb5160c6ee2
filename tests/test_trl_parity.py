"""hf_grpo.GRPOTrainer trains exactly like trl.GRPOTrainer, for every loss type TRL offers.

Both trainers start from the same checkpoint (so TRL can build the reference model from its path when
beta > 0), see the same data, seed and completions (generation is replaced by a fixed function of the
prompt), and run with the same config values; hf_grpo adds only ``tensor_batch_size=5``, so its chunked
log-prob head really runs in several chunks. Its rows are scored padding-free (packed into one sequence, the
default), TRL's padded. In fp32 on CPU the chunked head differs from TRL's fused
head only in summation order, so every logged figure and every parameter update must agree to 1e-5.

Each run makes two optimizer steps of two micro-batches each (P=4, A=2, G=4): at step 1 the policy
still equals the reference and the old policy, so the KL term, the KL metric and the importance ratios
are trivial (0 and 1); step 2 is where they matter. With num_iterations=1 step 2 starts a new rollout;
with num_iterations=2 it is the second pass over the first rollout, against the old-policy log-probs
computed at rollout time.
"""

import dataclasses
import gc
import inspect
import re

import pytest
import torch
import trl
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

import hf_grpo
import hf_grpo.logprob_head
import hf_grpo.training.padding_free
import hf_grpo.training.prompt_groups
from hf_grpo.generation import HFGenerateBackend
from hf_grpo.ops import chunked_logprobs
from hf_grpo.recipe_support.tiny import save_tiny_checkpoint

# fp32 on CPU: the two heads differ only in summation order (chunks of 5 rows against TRL's tiles).
# Update: norm of the difference of the two updates / norm of TRL's update, per optimizer step. Measured at most
# 3.6e-6: an absolute floor of ~2e-8 (the new fp32 weights round 1 ulp apart in a few hundred entries) over
# updates of norm 5e-3 to 5e-2. Logged figures: measured at most 2e-6 relative (step 2's kl).
RTOL = 1e-5
LOG_RTOL, LOG_ATOL = 1e-5, 1e-7  # the atol covers figures that are ~0 (step 1's kl, grpo's loss)

# Logged keys that measure time, not training.
TIMING = re.compile(r"^(perf/|step_time$|train_runtime$|train_samples_per_second$|train_steps_per_second$)")

PROMPTS = ["ab>", "c>", "defg>", "h>", "ij>", "klmno>", "p>", "qr>"]


def trl_loss_types() -> list[str]:
    """The loss types trl.GRPOConfig documents as supported (its field help: "Supported values are ...")."""
    field = next(f for f in dataclasses.fields(trl.GRPOConfig) if f.name == "loss_type")
    supported = field.metadata["help"].split("Supported values are", 1)[1].split(".", 1)[0]
    return re.findall(r"'([a-z_]+)'", supported)


LOSS_TYPES = trl_loss_types()


def test_loss_type_list_covers_every_branch_of_trls_loss():
    # Guards the parametrization: a loss type that TRL's _compute_loss handles but its help text does not
    # name (or the reverse) would otherwise go untested.
    source = inspect.getsource(trl.GRPOTrainer._compute_loss)
    branched = set(re.findall(r'self\.loss_type\s*[!=]=\s*"(\w+)"', source))
    for group in re.findall(r"self\.loss_type in \[([^\]]*)\]", source):
        branched |= set(re.findall(r'"(\w+)"', group))
    assert {"grpo", "dr_grpo", "bnpo", "dapo", trl.GRPOConfig.loss_type} <= set(LOSS_TYPES), LOSS_TYPES
    assert branched == set(LOSS_TYPES), f"TRL's loss code branches on {sorted(branched)}, its help names {LOSS_TYPES}"


@pytest.fixture(autouse=True, scope="module")
def _fast_tiny_runs():
    # Speed only. Tiny models on a busy 2-core machine: one intra-op thread is several times faster than two.
    # Each Trainer.train() runs gc.collect() (accelerate's free_memory), which would walk every object the
    # imports made; frozen, they are skipped (unfrozen, hence collectable again, after the module).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    gc.freeze()
    yield
    gc.unfreeze()
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny_checkpoint"))


def count_a_reward(completions, **kwargs):
    return [text.count("a") / 4 for text in completions]


def fixed_completions(tokenizer):
    """Completions that differ within a group and depend only on the prompt and its row (byte-level ids)."""
    letters = tokenizer.convert_tokens_to_ids(list("abcab"))

    def complete(prompt_ids):
        return [[letters[(len(p) + row) % 5]] * (1 + row % 4) + [tokenizer.eos_token_id]
                for row, p in enumerate(prompt_ids)]

    return complete


class FixedBackend(HFGenerateBackend):
    def __init__(self, complete):
        self.complete = complete

    def generate(self, model, prompt_ids, **kwargs):
        return self.complete(prompt_ids)


class RecordUpdates(TrainerCallback):
    """Each optimizer step's parameter update (after minus before)."""

    def __init__(self, model):
        self.model, self.updates = model, []
        self.last = self._snapshot()

    def _snapshot(self):
        return torch.cat([p.detach().flatten().clone() for p in self.model.parameters()])

    def on_step_end(self, args, state, control, **kwargs):
        now = self._snapshot()
        self.updates.append(now - self.last)
        self.last = now


def run(checkpoint, output_dir, ours, **fields):
    """Train ``max_steps`` optimizer steps; returns the step logs and each step's flattened parameter update."""
    values = dict(
        output_dir=str(output_dir), report_to=[], use_cpu=True, bf16=False, max_steps=2, seed=3,
        per_device_train_batch_size=4, gradient_accumulation_steps=2, num_generations=4, max_completion_length=6,
        # Plain SGD without gradient clipping: clipping would rescale every update to the same norm and hide an
        # error in the loss's scale. At this rate step 2 moves the policy enough that some ratios are clipped.
        learning_rate=0.01, max_grad_norm=0.0, optim="sgd", lr_scheduler_type="constant", logging_steps=1,
        save_strategy="no", disable_tqdm=True, activation_checkpointing=False,
    )
    values.update(fields)
    args = hf_grpo.GRPOConfig(**values, tensor_batch_size=5) if ours else trl.GRPOConfig(**values)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(checkpoint)
    assert model.dtype == torch.float32
    cls = hf_grpo.GRPOTrainer if ours else trl.GRPOTrainer
    trainer = cls(model=model, reward_funcs=count_a_reward, args=args, processing_class=tokenizer,
                  train_dataset=Dataset.from_dict({"prompt": [PROMPTS[i % len(PROMPTS)] for i in range(16)]}))
    complete = fixed_completions(tokenizer)
    if ours:
        trainer.decisions.backend = FixedBackend(complete)
    else:  # plain TRL: replace its generation method on the instance
        trainer._generate_single_turn = lambda prompt_ids, *a, **k: (complete(prompt_ids), None)
    if fields.get("beta", 0.0) > 0:
        assert trainer.ref_model is not None
    recorder = RecordUpdates(trainer.model)
    trainer.add_callback(recorder)
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    return logs, recorder.updates


# TRL's figures computed per micro-batch (means of each micro-batch's token means, clipped fractions and their
# extremes). Rows split into other micro-batches (a prompt's rows together: hf_grpo.training.prompt_groups, as TRL's
# own shuffle with another seed) give other figures for the same tokens: a few percent here.
PER_MICRO_BATCH = re.compile(r"^(entropy|kl|clip_ratio/.*)$")


def assert_same_logs(ours_logs, trl_logs, regrouped=False):
    """Both runs logged two steps, and hf_grpo every figure TRL logged (timings aside), with the same value
    (``regrouped``: the per-micro-batch figures left out; the updates are compared whole)."""
    assert len(ours_logs) == len(trl_logs) == 2
    for step, (ours, theirs) in enumerate(zip(ours_logs, trl_logs), start=1):
        keys = {k for k in theirs if not TIMING.match(k)}
        assert keys <= set(ours), f"step {step}: hf_grpo did not log {sorted(keys - set(ours))}"
        for key in sorted(keys - ({k for k in keys if PER_MICRO_BATCH.match(k)} if regrouped else set())):
            assert ours[key] == pytest.approx(theirs[key], rel=LOG_RTOL, abs=LOG_ATOL), (
                f"step {step}: {key} is {ours[key]} in hf_grpo, {theirs[key]} in TRL")


def assert_same_updates(ours_updates, trl_updates):
    assert len(ours_updates) == len(trl_updates) == 2
    for step, (ours, theirs) in enumerate(zip(ours_updates, trl_updates), start=1):
        assert theirs.norm() > 0, f"step {step} changed no parameter: the comparison would be empty"
        relative = ((ours - theirs).norm() / theirs.norm()).item()
        assert relative < RTOL, f"step {step}: updates differ by {relative:.2e} (relative)"


def spy_on_chunked_head(monkeypatch) -> list[tuple[int, int]]:
    """(rows, chunk_rows) of every call of hf_grpo's chunked head from now on."""
    calls = []

    def spy(hidden, *args, chunk_rows, **kwargs):
        calls.append((hidden.shape[0], chunk_rows))
        return chunked_logprobs(hidden, *args, chunk_rows=chunk_rows, **kwargs)

    monkeypatch.setattr(hf_grpo.logprob_head, "chunked_logprobs", spy)
    return calls


@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("num_iterations", [1, 2])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_two_steps_equal_trls(tmp_path, monkeypatch, checkpoint, loss_type, num_iterations, beta):
    fields = dict(loss_type=loss_type, num_iterations=num_iterations, beta=beta)
    if loss_type == "luspo":
        fields["importance_sampling_level"] = "sequence"  # as the LUSPO paper (TRL warns otherwise)
    if loss_type == "cispo":
        fields["epsilon_high"] = 5.0  # TRL's recommended value; its default (0.2) clamps every ratio to 0.2
    calls = spy_on_chunked_head(monkeypatch)
    ours_logs, ours_updates = run(checkpoint, tmp_path / "ours", ours=True, **fields)
    monkeypatch.undo()
    # hf_grpo's head really ran, in chunks: every call with chunk_rows=5, some over more rows than that.
    assert calls and {chunk for _, chunk in calls} == {5} and max(rows for rows, _ in calls) > 5, calls
    trl_logs, trl_updates = run(checkpoint, tmp_path / "trl", ours=False, **fields)

    assert_same_logs(ours_logs, trl_logs)
    for theirs in trl_logs:
        assert {"loss", "grad_norm", "entropy"} <= set(theirs)
        assert ("kl" in theirs) == (beta > 0)
    # The regime is not trivial: step 2's policy is off the reference, and off the old policy enough that the
    # clipped loss types clip some tokens but not all.
    if beta > 0:
        assert trl_logs[1]["kl"] > 1e-4
    if num_iterations == 2 and "clip_ratio/region_mean" in trl_logs[1]:
        assert 0 < trl_logs[1]["clip_ratio/region_mean"] < 1

    assert_same_updates(ours_updates, trl_updates)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_padding_free_two_steps_equal_trls_padded(tmp_path, monkeypatch, checkpoint, loss_type):
    # Rows packed into one sequence (padding_free) against TRL's padded rows, in the case where most can go
    # wrong: a reference model, and a second pass over the rollout against the old policy's log-probs.
    fields = dict(loss_type=loss_type, num_iterations=2, beta=0.04, padding_free=True)
    if loss_type == "luspo":
        fields["importance_sampling_level"] = "sequence"
    if loss_type == "cispo":
        fields["epsilon_high"] = 5.0
    packed = []  # tokens of every micro-batch hf_grpo scored packed
    regrouped = []  # rollouts whose rows hf_grpo grouped by prompt into the micro-batches (prompt_groups)

    def packed_spy(model, backbone, rows, **kwargs):
        packed.append(rows.tokens)
        return real_packed(model, backbone, rows, **kwargs)

    def regroup_spy(micro_batches):
        regrouped.append(len(micro_batches))
        return real_regroup(micro_batches)

    real_packed = hf_grpo.training.padding_free.packed_hidden_states
    calls = spy_on_chunked_head(monkeypatch)
    real_regroup = hf_grpo.training.prompt_groups.regroup
    monkeypatch.setattr(hf_grpo.training.padding_free, "packed_hidden_states", packed_spy)
    monkeypatch.setattr(hf_grpo.training.prompt_groups, "regroup", regroup_spy)
    ours_logs, ours_updates = run(checkpoint, tmp_path / "ours", ours=True, **fields)
    monkeypatch.undo()
    assert packed and len(packed) == len(calls), "not every forward ran its rows packed"
    # one rollout (two steps of num_iterations 2): each prompt's 4 rows in one micro-batch of 4, where that cannot
    # change the step (bnpo's can)
    assert regrouped == ([2] if loss_type in hf_grpo.training.prompt_groups.ORDER_FREE_LOSSES else [])
    fields.pop("padding_free")
    trl_logs, trl_updates = run(checkpoint, tmp_path / "trl", ours=False, **fields)
    assert_same_logs(ours_logs, trl_logs, regrouped=bool(regrouped))
    assert_same_updates(ours_updates, trl_updates)


# Mixture-of-experts checkpoints with their family's defaults: router_aux_loss_coef=0.001, so TRL adds the router's
# load-balancing loss and logs it as aux_loss. "+router_logits": a config saved with output_router_logits=True.
MOE_CASES = {"qwen2_moe": {}, "qwen3_moe": {}, "mixtral": {}, "olmoe": {},
             "qwen2_moe+router_logits": {"output_router_logits": True}}


@pytest.mark.parametrize("case", sorted(MOE_CASES))
def test_moe_checkpoint_trains_as_in_trl(tmp_path, monkeypatch, case):
    checkpoint = save_tiny_checkpoint(tmp_path / "moe", moe=case.split("+")[0], **MOE_CASES[case])
    fields = dict(beta=0.04, num_iterations=2)  # reference and old-policy scoring run through the head too
    calls = spy_on_chunked_head(monkeypatch)
    ours_logs, ours_updates = run(checkpoint, tmp_path / "ours", ours=True, **fields)
    monkeypatch.undo()
    assert calls and {chunk for _, chunk in calls} == {5}, "hf_grpo's chunked head did not score the MoE model"
    trl_logs, trl_updates = run(checkpoint, tmp_path / "trl", ours=False, **fields)

    assert all("aux_loss" in logs and logs["aux_loss"] > 0 for logs in trl_logs), trl_logs
    assert_same_logs(ours_logs, trl_logs)  # aux_loss and loss among them
    assert_same_updates(ours_updates, trl_updates)


def save_tiny_gpt2_checkpoint(directory) -> str:
    """A tiny GPT-2 with its dropout left on (GPT2Config's 0.1 on embeddings, attention and residuals)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from hf_grpo.recipe_support.tiny import build_byte_level_tokenizer

    tokenizer = build_byte_level_tokenizer()
    ids = dict(bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id,
               pad_token_id=tokenizer.pad_token_id)
    config = GPT2Config(vocab_size=len(tokenizer), n_positions=64, n_embd=32, n_layer=2, n_head=2, **ids)
    assert config.resid_pdrop == config.embd_pdrop == config.attn_pdrop == 0.1
    torch.manual_seed(0)
    GPT2LMHeadModel(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory)


def test_gpt2_with_dropout_equals_trls(tmp_path, caplog):
    # Dropout on in train mode: the old-policy scoring (num_iterations=2) draws its masks chunk by chunk, so its
    # log-probs, and from them step 2's ratios, equal TRL's only when the chunks are TRL's own.
    checkpoint = save_tiny_gpt2_checkpoint(tmp_path / "gpt2")
    fields = dict(num_iterations=2)
    with caplog.at_level("INFO", logger="hf_grpo"):
        ours_logs, ours_updates = run(checkpoint, tmp_path / "ours", ours=True, **fields)
    assert "TRL's chunks of per_device_train_batch_size rows: dropout is active in train mode" in caplog.text
    trl_logs, trl_updates = run(checkpoint, tmp_path / "trl", ours=False, **fields)
    assert_same_logs(ours_logs, trl_logs)
    assert_same_updates(ours_updates, trl_updates)
