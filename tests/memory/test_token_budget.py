"""Token-budget micro-batches (max_tokens_per_micro_batch): packing, config, and float64 gradient exactness.

The exactness tests run one TRL micro-batch through hf_grpo's ``compute_loss`` twice on a float64 model:
in one pass (the fixed-size computation) and in unequal token-budget passes, and compare the loss and
every parameter's gradient to 1e-12 relative, for each supported loss type.
"""

import json
import pathlib
import random

import pytest
import torch
from tests.project_files import load_bench
from tests.scripts.token_budget_train import float64_rope
from tests.distributed.test_launch import launch
from tests.test_trainer import TOKENIZER, assert_same_update, make_trainer, train_one_step

from hf_grpo import GRPOTrainer
from hf_grpo.cli.main import build_plan
from hf_grpo.memory import token_budget
from hf_grpo.memory.packing import (
    Extents,
    balanced_passes,
    build_passes,
    first_fit_decreasing,
    pass_tokens,
    plan_passes,
    select_rows,
)
from hf_grpo.recipe_support.tiny import build_tiny_model
from hf_grpo.run_state import RunFacts

EXACT = dict(rtol=1e-12, atol=1e-15)
# loss_type -> extra config TRL needs for it
LOSS_TYPES = {
    "grpo": {}, "sapo": {}, "bnpo": {}, "dr_grpo": {}, "dapo": {}, "cispo": {}, "vespo": {},
    "luspo": {"importance_sampling_level": "sequence"},
}


# ---- packing ---------------------------------------------------------------------------------------
def test_first_fit_decreasing_packs_longest_first_into_padded_budget():
    # rows' (prompt, completion) extents; a pass costs rows x (longest prompt + longest completion)
    ext = Extents(prompt=[2, 3, 2, 1, 3], completion=[6, 1, 2, 7, 4])
    # longest first: 3 (8 tokens), 0 (8; with 3 it would cost 2 x (2 + 7) = 18), 4, 2 (joins 0), 1 (joins 4)
    assert first_fit_decreasing(ext, budget=16) == [[3], [0, 2], [4, 1]]
    assert [pass_tokens(rows, ext) for rows in [[3], [0, 2], [4, 1]]] == [8, 16, 14]


def test_every_row_lands_in_one_pass_within_budget_and_every_rank_gets_the_agreed_count():
    rng = random.Random(0)
    for _ in range(300):
        n, budget = rng.randint(1, 12), rng.randint(8, 60)
        ext = Extents([rng.randint(1, 4) for _ in range(n)], [rng.randint(0, 4) for _ in range(n)])
        own = len(first_fit_decreasing(ext, budget))
        agreed = own + rng.randint(0, 3)  # another rank needs more passes
        passes = plan_passes(ext, budget, agree=lambda count, agreed=agreed: agreed)
        assert len(passes) == agreed
        assert sorted(r for rows in passes for r in rows) == list(range(n))
        assert all(pass_tokens(rows, ext) <= budget for rows in passes)
        assert all(rows for rows in passes[: min(n, agreed)]), "empty (zero-weight) passes come last"


def test_balanced_passes_even_out_tokens_that_first_fit_piles_up():
    ext = Extents(prompt=[1] * 6, completion=[3] * 6)  # six rows of 4 tokens
    assert [len(rows) for rows in first_fit_decreasing(ext, budget=20)] == [5, 1]
    balanced = balanced_passes(ext, budget=20, count=2)
    assert [len(rows) for rows in balanced] == [3, 3]
    assert [pass_tokens(rows, ext) for rows in balanced] == [12, 12]


def test_a_row_longer_than_the_budget_is_an_error_naming_field_budget_and_length():
    ext = Extents(prompt=[3, 5], completion=[2, 9])
    with pytest.raises(ValueError, match=r"max_tokens_per_micro_batch=10 .* row 1 .* 5 prompt \+ 9 completion = 14"):
        plan_passes(ext, budget=10)


def test_a_budget_the_longest_prompt_cannot_fill_is_refused_at_train_start(tmp_path):
    """Not at the first step that happens to sample a full-length completion for that prompt, maybe hours in."""
    trainer = make_trainer(tmp_path, max_tokens_per_micro_batch=64, max_completion_length=6)
    longest = trainer._longest_prompt()
    assert longest > 0
    trainer.sizes.max_tokens_per_micro_batch = longest + 5  # one token short of the longest prompt's full row
    with pytest.raises(ValueError, match=rf"max_tokens_per_micro_batch={longest + 5} .*longest prompt \({longest} "
                                         rf"tokens\) .*max_completion_length=6 .*>= {longest + 6}"):
        trainer.train()
    assert trainer.state.global_step == 0
    trainer.sizes.max_tokens_per_micro_batch = longest + 6  # exactly enough: trains
    trainer.train()
    assert trainer.state.global_step == 1


def test_without_a_budget_train_start_does_not_scan_the_training_set(tmp_path, monkeypatch):
    """The scan tokenizes every prompt: a run that sets no budget (and no "auto", no cuda_graph cache) skips it."""
    trainer = make_trainer(tmp_path, max_tokens_per_micro_batch=None, max_completion_length=6)
    monkeypatch.setattr("hf_grpo.trainer.prompt_lengths.longest_prompt",
                        lambda *a, **k: pytest.fail("the training set was scanned"))
    trainer.train()
    assert trainer.state.global_step == 1


def micro_batch(rows=8, prompt_width=5, completion_width=7, vary_prompts=False, seed=0):
    """A TRL micro-batch: left-padded prompts, right-padded completions of 1..completion_width tokens."""
    g = torch.Generator().manual_seed(seed)
    prompt_lengths = [prompt_width - (r % 3 if vary_prompts else 0) for r in range(rows)]
    completion_lengths = [1 + (r * 5) % completion_width for r in range(rows)]
    prompt_ids = torch.randint(2, 30, (rows, prompt_width), generator=g)
    completion_ids = torch.randint(2, 30, (rows, completion_width), generator=g)
    prompt_mask = torch.zeros(rows, prompt_width, dtype=torch.long)
    completion_mask = torch.zeros(rows, completion_width, dtype=torch.long)
    for r in range(rows):
        prompt_mask[r, prompt_width - prompt_lengths[r]:] = 1
        prompt_ids[r, : prompt_width - prompt_lengths[r]] = TOKENIZER.pad_token_id
        completion_mask[r, : completion_lengths[r]] = 1
        completion_ids[r, completion_lengths[r]:] = TOKENIZER.pad_token_id
    logps = lambda: -3 + 0.3 * torch.randn(rows, completion_width, generator=g, dtype=torch.float64)
    return dict(
        prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=completion_ids,
        completion_mask=completion_mask, advantages=torch.randn(rows, generator=g, dtype=torch.float64),
        # dapo/cispo/vespo divide by the rollout's tokens over all ranks: any global constant will do
        num_items_in_batch=torch.tensor(float(3 * completion_mask.sum())),
        old_per_token_logps=logps(), ref_per_token_logps=logps(),
    )


def test_select_rows_cuts_the_padding_its_rows_do_not_use():
    inputs = micro_batch(vary_prompts=True)
    ext = token_budget.extents(inputs)
    assert ext.prompt == [5, 4, 3, 5, 4, 3, 5, 4] and ext.completion == [1, 6, 4, 2, 7, 5, 3, 1]
    part = select_rows(inputs, [2, 5], ext)  # prompts of 3, completions of 4 and 5
    assert part["prompt_ids"].shape == (2, 3) and part["completion_ids"].shape == (2, 5)
    assert part["old_per_token_logps"].shape == (2, 5) and part["advantages"].shape == (2,)
    assert torch.equal(part["prompt_ids"], inputs["prompt_ids"][[2, 5], 2:])
    assert torch.equal(part["completion_mask"], inputs["completion_mask"][[2, 5], :5])
    assert part["num_items_in_batch"] is inputs["num_items_in_batch"]


def test_inputs_it_cannot_split_are_refused_by_name():
    inputs = {**micro_batch(), "pixel_values": torch.zeros(3, 4)}
    with pytest.raises(ValueError, match=r"'pixel_values'.*max_tokens_per_micro_batch=None"):
        select_rows(inputs, [0], token_budget.extents(inputs))


# ---- configuration and plan --------------------------------------------------------------------
@pytest.mark.parametrize("bad", [0, -5, 2.5, True, "64"])
def test_budget_must_be_a_positive_integer(make_config, bad):
    with pytest.raises(ValueError, match=r"max_tokens_per_micro_batch must be an integer >= 1 .* got"):
        make_config(max_tokens_per_micro_batch=bad)


def test_budget_below_one_full_completion_is_refused(make_config):
    with pytest.raises(ValueError, match=r"max_tokens_per_micro_batch \(64\) .* max_completion_length \(64\) \+ 1"):
        make_config(max_tokens_per_micro_batch=64, max_completion_length=64)
    make_config(max_tokens_per_micro_batch=65, max_completion_length=64)


@pytest.mark.parametrize("settings, match", [
    ({"top_entropy_quantile": 0.2}, r"top_entropy_quantile=0.2"),
    ({"entropy_coef": 0.01, "loss_type": "grpo"}, r"entropy bonus .* only for loss_type='bnpo'"),
    ({"use_adaptive_entropy": True, "entropy_coef": 0.01, "loss_type": "dapo"}, r"entropy bonus"),
])
def test_settings_that_cannot_be_made_exact_are_refused(make_config, settings, match):
    with pytest.raises(ValueError, match=match):
        make_config(max_tokens_per_micro_batch=4096, **settings)


def test_every_supported_loss_type_is_accepted(make_config):
    for loss_type, extra in LOSS_TYPES.items():
        config = make_config(max_tokens_per_micro_batch=4096, loss_type=loss_type, **extra)
        assert config.max_tokens_per_micro_batch == 4096
    make_config(max_tokens_per_micro_batch=4096, loss_type="bnpo", entropy_coef=0.01)  # exact: see the bnpo test


def test_batch_plan_and_cli_show_the_budget(make_config):
    plan = make_config(max_tokens_per_micro_batch=8192, per_device_train_batch_size=8).batch_plan()
    assert plan.max_tokens_per_micro_batch == 8192
    assert "passes of at most 8192 padded tokens (max_tokens_per_micro_batch)" in str(plan)
    assert "max_tokens_per_micro_batch" not in str(make_config().batch_plan())
    assert build_plan(["--max_tokens_per_micro_batch", "4096"]).max_tokens_per_micro_batch == 4096


# ---- float64 exactness -------------------------------------------------------------------------------
def float64_trainer(tmp_path, loss_type="grpo", rope64=False, **overrides):
    model = build_tiny_model(TOKENIZER, dtype=torch.float64)
    trainer = make_trainer(tmp_path, model=float64_rope(model) if rope64 else model, loss_type=loss_type,
                           **LOSS_TYPES[loss_type], **overrides)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 2  # the /A of TRL's loss is in both computations
    trainer.beta = 0.1  # the KL term too (reads inputs["ref_per_token_logps"]; no reference model needed)
    return trainer


def loss_and_grads(trainer, inputs, budget):
    trainer.sizes.max_tokens_per_micro_batch = budget
    trainer.model.zero_grad()
    loss = trainer.compute_loss(trainer.model, inputs)
    trainer.accelerator.backward(loss)  # what transformers' training_step does with it
    return loss.detach(), {name: p.grad.clone() for name, p in trainer.model.named_parameters()}


def assert_exact(fixed, packed):
    torch.testing.assert_close(packed[0], fixed[0], **EXACT)
    assert fixed[1].keys() == packed[1].keys()
    assert sum(g.abs().sum() for g in fixed[1].values()) > 0, "no gradient: the comparison would be empty"
    for name in fixed[1]:
        torch.testing.assert_close(packed[1][name], fixed[1][name], **EXACT, msg=name)


def pass_sizes(inputs, budget, loss_type="grpo"):
    return [len(p.rows) for p in build_passes(inputs, budget, loss_type, agree=lambda count: count)]


@pytest.mark.parametrize("loss_type", sorted(LOSS_TYPES))
def test_packed_gradient_equals_the_one_pass_gradient_float64(tmp_path, loss_type):
    trainer = float64_trainer(tmp_path, loss_type)
    inputs = micro_batch()  # same-length prompts, completions of 1 to 7 tokens
    assert sorted(pass_sizes(inputs, 20)) == [1, 1, 2, 2, 2], "unequal passes, or the test would prove little"
    assert_exact(loss_and_grads(trainer, inputs, None), loss_and_grads(trainer, inputs, 20))


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dapo"])
def test_packed_gradient_with_varied_prompt_lengths_float64(tmp_path, loss_type):
    # The passes cut left padding, shifting positions; with float64 RoPE angles that is exact too.
    trainer = float64_trainer(tmp_path, loss_type, rope64=True)
    inputs = micro_batch(vary_prompts=True)
    assert len(set(pass_sizes(inputs, 18))) > 1
    assert_exact(loss_and_grads(trainer, inputs, None), loss_and_grads(trainer, inputs, 18))


@pytest.mark.parametrize("adaptive", [False, True], ids=["static", "adaptive"])
def test_bnpo_with_entropy_bonus_is_exact_float64(tmp_path, adaptive):
    trainer = float64_trainer(tmp_path, "bnpo", entropy_coef=0.05, use_adaptive_entropy=adaptive)
    inputs = micro_batch()
    results, controller = [], []
    for budget in (None, 20):
        # the adaptive bonus applies while the last window's entropy is at or below entropy_target
        trainer.entropy_coef, trainer._last_world_entropy = 0.05, 0.0
        results.append(loss_and_grads(trainer, inputs, budget))
        controller.append((trainer.entropy_coef, trainer._last_world_entropy, trainer._entropy_window_stats))
    assert_exact(*results)
    if adaptive:  # the window closed once, on the last pass, over all the micro-batch's tokens
        (coef, entropy, window), (packed_coef, packed_entropy, packed_window) = controller
        assert window is None and packed_window is None and packed_coef == coef == 0.05 - 0.005
        assert packed_entropy == pytest.approx(entropy, rel=1e-12) and entropy > 0


def test_zero_weight_passes_add_no_gradient(tmp_path, monkeypatch):
    trainer = float64_trainer(tmp_path, "grpo")
    inputs = micro_batch()
    fixed = loss_and_grads(trainer, inputs, None)
    calls = []
    real = trainer.__class__.__mro__[1].compute_loss  # TRL's, which each pass runs

    def counting(self, model, part, *args, **kwargs):
        calls.append(int(part["completion_mask"].sum()))
        return real(self, model, part, *args, **kwargs)

    monkeypatch.setattr(type(trainer).__mro__[1], "compute_loss", counting)
    # another rank needs 10 passes: this rank's 8 rows take 8 of them, one each, and 2 train nothing
    monkeypatch.setattr(token_budget, "agree_on_count", lambda accelerator: lambda count: 10)
    packed = loss_and_grads(trainer, inputs, 20)
    assert len(calls) == 10 and calls[-2:] == [0, 0] and all(calls[:8]), calls
    assert_exact(fixed, packed)


def test_every_pass_but_the_last_defers_gradient_sync(tmp_path, monkeypatch):
    trainer = float64_trainer(tmp_path, "grpo")
    seen = []
    real = type(trainer).__mro__[1].compute_loss

    def recording(self, model, part, *args, **kwargs):
        seen.append(self.accelerator.sync_gradients)
        return real(self, model, part, *args, **kwargs)

    monkeypatch.setattr(type(trainer).__mro__[1], "compute_loss", recording)
    loss_and_grads(trainer, micro_batch(), 20)
    assert seen == [False] * 4 + [True]  # the last pass is the Trainer's own backward, on the sync step
    assert trainer.accelerator.sync_gradients


def test_eval_runs_in_one_pass(tmp_path):
    trainer = float64_trainer(tmp_path, "grpo")
    inputs = micro_batch()
    trainer.model.eval()
    trainer.sizes.max_tokens_per_micro_batch = 20
    with torch.no_grad():
        loss = trainer.compute_loss(trainer.model, inputs)
    trainer.sizes.max_tokens_per_micro_batch = None
    with torch.no_grad():
        torch.testing.assert_close(loss, trainer.compute_loss(trainer.model, inputs), rtol=0, atol=0)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_trl_scoring_chunks_are_twice_the_micro_batch_within_the_budget_and_give_the_same_logps(tmp_path, attention):
    # TRL scores the rollout (old policy, reference) without grad, batch_size=P rows of its full padded width; the
    # trainer runs 2P a chunk (P where attention materialises its scores), at most 2 x budget tokens
    trainer = float64_trainer(tmp_path, "grpo")
    trainer.model.config._attn_implementation = attention
    inputs = micro_batch()
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)  # 8 rows x 12 columns
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    rows = []
    hook = trainer.model.register_forward_pre_hook(lambda m, a, kw: rows.append(kw["input_ids"].shape[0]),
                                                   with_kwargs=True)
    logps, chunks = {}, {}
    with torch.no_grad():
        for budget in (None, 18, 6):  # 2 x 18 // 12 = 3 rows a chunk; 6 tokens: below one row, one row a chunk
            trainer.sizes.max_tokens_per_micro_batch = budget
            rows.clear()
            logps[budget] = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, 7, batch_size=2)[0]
            chunks[budget] = list(rows)
    hook.remove()
    if attention == "sdpa":
        assert chunks == {None: [4, 4], 18: [3, 3, 2], 6: [1] * 8}
    else:
        assert chunks == {None: [2, 2, 2, 2], 18: [1] * 8, 6: [1] * 8}
    for budget in (18, 6):
        torch.testing.assert_close(logps[budget], logps[None], **EXACT)


# ---- trainer-level refusals and a real run --------------------------------------------------------
def test_a_trainer_with_its_own_loss_is_refused(tmp_path):
    class OwnLoss(GRPOTrainer):
        def _compute_loss(self, model, inputs):
            return super()._compute_loss(model, inputs)

    with pytest.raises(ValueError, match=r"max_tokens_per_micro_batch=4096 is not supported by OwnLoss"):
        make_trainer(tmp_path, cls=OwnLoss, max_tokens_per_micro_batch=4096)


def test_a_router_aux_loss_is_refused():
    facts = RunFacts(aux_loss_enabled=True, router_aux_loss_coef=0.001)  # a model with a MoE router loss
    with pytest.raises(ValueError, match=r"router_aux_loss_coef=0.001"):
        token_budget.check_run(facts, 4096)
    token_budget.check_run(facts, None)  # no budget: nothing to split


@pytest.mark.slow
def test_training_with_a_token_budget_matches_one_pass(tmp_path, monkeypatch):
    """Two optimizer steps of real GRPO training (generation, rewards, accumulation), prompts of 2 to 6 tokens."""
    sizes = []
    real = token_budget.build_passes

    def spy(*args, **kwargs):
        passes = real(*args, **kwargs)
        sizes.append([len(p.rows) for p in passes])
        return passes

    monkeypatch.setattr(token_budget, "build_passes", spy)
    common = dict(max_steps=2, gradient_accumulation_steps=2, per_device_train_batch_size=4, loss_type="bnpo")
    one_pass = train_one_step(make_trainer(tmp_path / "a", **common))
    assert not sizes
    packed = train_one_step(make_trainer(tmp_path / "b", max_tokens_per_micro_batch=14, **common))
    assert len(sizes) == 4 and all(len(s) > 1 for s in sizes), sizes  # 4 micro-batches, each in several passes
    assert_same_update(one_pass, packed)  # float32 (DESIGN: 1e-5 relative)


@pytest.mark.slow
@pytest.mark.launch
@pytest.mark.parametrize("config, rtol", [("multi_gpu", 1e-12), ("zero2", 1e-5), ("zero3", 1e-5)])
def test_two_processes_needing_different_pass_counts_run_equally_many_and_match(tmp_path, config, rtol):
    """DDP over gloo (float64: exact) and DeepSpeed ZeRO-2/3 (whose own reductions differ from DDP by ~1e-7; ZeRO-3
    partitions float32 parameters, not float64)."""
    script = "tests/scripts/token_budget_train.py"
    launch(config, script, tmp_path, "none", 16)  # one pass, then packed, in one launch
    one_pass_dir, packed_dir = tmp_path / "budget_none", tmp_path / "budget_16"
    ranks = [json.loads((packed_dir / f"passes_rank{r}.json").read_text()) for r in (0, 1)]
    assert len(ranks[0]) == len(ranks[1]) == 4  # 2 optimizer steps x 2 micro-batches
    assert [ran for _, ran in ranks[0]] == [ran for _, ran in ranks[1]], "every rank runs as many passes"
    assert any(a[0] != b[0] for a, b in zip(*ranks)), "the ranks' own rows needed different numbers of passes"
    dtype = torch.float32 if config == "zero3" else torch.float64  # as the script builds it
    initial = dict(build_tiny_model(TOKENIZER, seed=0, dtype=dtype).named_parameters())

    def update(run: pathlib.Path) -> torch.Tensor:
        params = torch.load(run / "params.pt")
        return torch.cat([(params[name] - initial[name].detach()).flatten() for name in sorted(params)])

    one_pass, packed = update(one_pass_dir), update(packed_dir)
    assert one_pass.norm() > 0
    assert ((packed - one_pass).norm() / one_pass.norm()).item() < rtol


def test_the_gpu_benchmark_runs_budgets_and_fixed_micro_batches_to_the_one_pass_gradient(capsys):
    """bench/token_budget.py --tiny: every setting it will measure on the GPU gives the one-pass gradient."""
    bench = load_bench("token_budget")
    bench.main(["--tiny"])
    records = [json.loads(line[len("RESULT "):]) for line in capsys.readouterr().out.splitlines()
               if line.startswith("RESULT ")]
    assert [(r["budget"], r["fixed_rows"]) for r in records] == [(None, None), (48, None), (96, None), (None, 2),
                                                                   (None, 4)]
    assert all(not r["out_of_memory"] and r["grad_rel_diff_vs_one_pass"] < 1e-5 for r in records), records
    one_pass = records[0]["padded_tokens"]
    assert all(r["padded_tokens"] < one_pass for r in records if r["budget"])  # the budgets cut padding
    assert all(r["padded_tokens"] == one_pass for r in records if r["fixed_rows"])  # fixed ones keep it all


def test_scoring_keeps_trls_chunks_where_dropout_is_active():
    # A model in train mode with dropout draws masks chunk by chunk: only TRL's P rows give TRL's log-probs.
    from transformers import GPT2Config, GPT2LMHeadModel
    from trl.trainer.utils import disable_dropout_in_model

    model = GPT2LMHeadModel(GPT2Config(vocab_size=16, n_positions=16, n_embd=8, n_layer=1, n_head=2)).train()
    rows, why = token_budget.scoring_chunk_rows(model, 4, 12, None)
    assert rows == 4 and "dropout is active" in why and "p=0.1" in why
    assert token_budget.scoring_chunk_rows(model.eval(), 4, 12, None)[0] == 8  # TRL's reference: eval mode
    disable_dropout_in_model(model.train())  # disable_dropout=True
    assert token_budget.active_dropout(model) is None
    assert token_budget.scoring_chunk_rows(model, 4, 12, None)[0] == 8
    assert token_budget.scoring_rows(4, 12, 24, "sdpa", dropout="drop (p=0.1)") == 2  # within the budget still


def test_attention_dropout_is_named_with_what_lifts_it():
    """A float ``attention_dropout`` is read by the attention function, not an nn.Dropout: disable_dropout leaves it,
    so the reason names the config field instead."""
    from hf_grpo.recipe_support.tiny import build_char_tokenizer, build_tiny_model

    model = build_tiny_model(build_char_tokenizer(), attention_dropout=0.1).train()
    rows, why = token_budget.scoring_chunk_rows(model, 4, 12, None)
    assert rows == 4 and "attention_dropout" in why and "attention_dropout=0 in the model's config" in why
    assert "disable_dropout=True" not in why
