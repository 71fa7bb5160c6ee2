"""The dense generation mirror: a plain copy of the policy that ZeRO-3 rollouts decode from.

CPU tests check what the trainer relies on: after ``refresh`` the mirror computes exactly the
policy's logits (plain, tied embeddings, LoRA merged as PEFT merges it), its tensors never move
while their values follow optimizer steps, and the "auto" decision and the config field. The
two-process DeepSpeed ZeRO-3 run (marked slow) checks the layer-by-layer gather against the
fully gathered model inside a short GRPO training run, and the one-process run the partitions read in place (no
copy); the GPU test checks that the CUDA-graph
decoder reading the mirror is captured once across refreshes.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import pathlib

import pytest
import torch
from tests.launching import accelerate_command, run_launch
from transformers import GenerationConfig, Qwen2ForCausalLM

from hf_grpo.generation import dense_mirror
from hf_grpo.generation.dense_mirror import DenseMirror, MirrorChoice, decide, fits, planned_nbytes
from hf_grpo.plan import BatchPlan
from hf_grpo.recipe_support.tiny import build_char_tokenizer, build_tiny_model

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


def _model(tokenizer, *, tied: bool = False, dtype=torch.float64, seed: int = 0) -> Qwen2ForCausalLM:
    model = build_tiny_model(tokenizer, dtype=dtype, seed=seed)
    if tied:  # the same shape with one embedding matrix shared by the input and the output
        config = copy.deepcopy(model.config)
        config.tie_word_embeddings = True
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config).to(dtype)
    return model.eval()


def _lora(model, seed: int = 1):
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]))
    torch.manual_seed(seed)
    for name, param in peft_model.named_parameters():
        if "lora_B" in name:  # B starts at zero; a non-zero delta makes the merge matter
            torch.nn.init.normal_(param, std=0.1)
    return peft_model.eval()


def _ids(n: int = 3, length: int = 9, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(2, 30, (n, length), generator=generator)


@torch.no_grad()
def _logits(model, ids):
    return model(ids).logits


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_refreshed_mirror_computes_the_policys_logits_exactly(tokenizer, tied):
    model = _model(tokenizer, tied=tied)
    mirror = DenseMirror(model)
    returned = mirror.refresh(model)
    assert returned is mirror.module
    assert torch.equal(_logits(mirror.module, _ids()), _logits(model, _ids()))
    for (name, ours), (_, theirs) in zip(mirror.module.named_parameters(), model.named_parameters()):
        assert ours.dtype == theirs.dtype and torch.equal(ours, theirs), name
        assert ours.data_ptr() != theirs.data_ptr()  # a copy, not a view of the policy
    # tied embeddings stay one tensor in the mirror: one copy of the memory, one copy per refresh
    assert (mirror.module.lm_head.weight is mirror.module.model.embed_tokens.weight) == tied
    assert mirror.nbytes == planned_nbytes(model) == (
        sum(p.numel() * p.element_size() for p in model.parameters())
        + sum(b.numel() * b.element_size() for b in model.buffers()))


def test_mirror_keeps_the_policys_dtype(tokenizer):
    model = _model(tokenizer, dtype=torch.bfloat16)
    mirror = DenseMirror(model)
    mirror.refresh(model)
    assert {p.dtype for p in mirror.module.parameters()} == {torch.bfloat16}
    assert torch.equal(_logits(mirror.module, _ids()), _logits(model, _ids()))


def test_lora_mirror_holds_the_merged_weights_as_a_plain_model(tokenizer):
    policy = _lora(_model(tokenizer))
    mirror = DenseMirror(policy)
    mirror.refresh(policy)
    assert type(mirror.module) is Qwen2ForCausalLM
    assert not any("lora" in name for name, _ in mirror.module.named_parameters())
    merged = copy.deepcopy(policy).merge_and_unload()  # PEFT's own merge: W + B A * scaling
    assert torch.equal(_logits(mirror.module, _ids()), _logits(merged, _ids()))
    for name, param in merged.named_parameters():
        assert torch.equal(mirror.module.get_parameter(name), param), name
    # and the adapter branch computed unmerged agrees up to float64 rounding
    torch.testing.assert_close(_logits(mirror.module, _ids()), _logits(policy, _ids()), rtol=1e-12, atol=1e-12)


def test_lora_mirror_follows_a_disabled_adapter(tokenizer):
    policy = _lora(_model(tokenizer))
    mirror = DenseMirror(policy)
    with policy.disable_adapter():
        mirror.refresh(policy)
        assert torch.equal(_logits(mirror.module, _ids()), _logits(policy, _ids()))
    mirror.refresh(policy)
    with policy.disable_adapter():
        assert not torch.equal(_logits(mirror.module, _ids()), _logits(policy, _ids()))


def _policy(tokenizer, kind: str):
    """A float64 policy: ``plain``, ``tied`` (one embedding matrix) or ``lora``."""
    policy = _model(tokenizer, tied=kind == "tied")
    return _lora(policy) if kind == "lora" else policy


def _one_optimizer_step(policy):
    optimizer = torch.optim.SGD([p for p in policy.parameters() if p.requires_grad], lr=0.5)
    policy.train()
    policy(_ids(), labels=_ids()).loss.backward()
    optimizer.step()
    policy.eval()


@pytest.mark.parametrize("kind", ["plain", "tied", "lora"])
def test_refresh_after_an_optimizer_step_keeps_addresses_and_follows_values(tokenizer, kind):
    policy = _policy(tokenizer, kind)
    mirror = DenseMirror(policy)
    mirror.refresh(policy)
    pointers = [p.data_ptr() for p in mirror.module.parameters()]
    before = _logits(mirror.module, _ids())

    _one_optimizer_step(policy)

    assert torch.equal(_logits(mirror.module, _ids()), before)  # nothing read before the refresh
    mirror.refresh(policy)
    assert [p.data_ptr() for p in mirror.module.parameters()] == pointers
    after = _logits(mirror.module, _ids())
    assert not torch.equal(after, before)
    expected = copy.deepcopy(policy).merge_and_unload() if kind == "lora" else policy
    assert torch.equal(after, _logits(expected, _ids()))


@pytest.mark.parametrize("kind", ["plain", "tied", "lora"])
def test_released_mirror_holds_no_memory_and_its_refresh_fills_it_again(tokenizer, kind):
    """Between rollouts (release_generation_memory) the copy gives its memory back; the next refresh allocates
    it again and writes every weight, the optimizer's step included: no value survives from before the release."""
    policy = _policy(tokenizer, kind)
    mirror = DenseMirror(policy)
    assert mirror.resident_nbytes == 0  # built without memory: the first refresh allocates the copy
    mirror.refresh(policy)
    params = list(mirror.module.parameters())
    held = sum(p.numel() * p.element_size() for p in params)
    assert mirror.resident_nbytes == held > 0

    mirror.release()
    assert mirror.resident_nbytes == 0 and all(p.untyped_storage().nbytes() == 0 for p in params)
    with pytest.raises(RuntimeError):  # a read before the refresh fails; it never sees stale weights
        _logits(mirror.module, _ids())

    _one_optimizer_step(policy)

    assert mirror.refresh(policy) is mirror.module
    assert list(mirror.module.parameters()) == params  # the same parameter objects, tied ones still one
    assert (mirror.module.lm_head.weight is mirror.module.model.embed_tokens.weight) == (kind == "tied")
    assert mirror.resident_nbytes == held
    expected = copy.deepcopy(policy).merge_and_unload() if kind == "lora" else policy
    assert torch.equal(_logits(mirror.module, _ids()), _logits(expected, _ids()))
    mirror.release()  # released and refilled again: a second cycle behaves as the first
    mirror.refresh(policy)
    assert torch.equal(_logits(mirror.module, _ids()), _logits(expected, _ids()))


def test_refresh_reads_through_a_ddp_wrapper(tokenizer, tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        model = _model(tokenizer)
        wrapped = torch.nn.parallel.DistributedDataParallel(model)
        mirror = DenseMirror(wrapped)
        mirror.refresh(wrapped)
        assert torch.equal(_logits(mirror.module, _ids()), _logits(model, _ids()))
    finally:
        dist.destroy_process_group()


def test_mirror_generates_what_the_policy_generates(tokenizer):
    policy = _lora(_model(tokenizer, dtype=torch.float32))
    mirror = DenseMirror(policy)
    mirror.refresh(policy)
    config = GenerationConfig(max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=1)
    ids = _ids(2, 5)
    with torch.no_grad():
        ours = mirror.module.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config)
        merged = copy.deepcopy(policy).merge_and_unload()
        theirs = merged.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config)
    assert torch.equal(ours, theirs)


def test_refresh_gathers_one_unit_at_a_time(tokenizer, monkeypatch):
    """Each refresh step reads one decoder layer or one module outside the layers (with ZeRO-3: one gather each)."""
    model = _model(tokenizer)
    mirror = DenseMirror(model)
    opened = []

    def recording(params):
        opened.append(sum(p.numel() for p in params))
        return contextlib.nullcontext()

    monkeypatch.setattr(dense_mirror, "gathered", recording)
    mirror.refresh(model)
    layers = [sum(p.numel() for p in layer.parameters()) for layer in model.model.layers]
    embed, norm, head = (model.model.embed_tokens.weight.numel(), model.model.norm.weight.numel(),
                         model.lm_head.weight.numel())
    assert opened == [embed, *layers, norm, head]


def test_unknown_adapter_wrappers_are_refused(tokenizer):
    from peft import IA3Config, PromptTuningConfig, get_peft_model

    ia3 = get_peft_model(_model(tokenizer), IA3Config(target_modules=["q_proj", "down_proj"],
                                                      feedforward_modules=["down_proj"]))
    with pytest.raises(ValueError, match=r"q_proj: .*copies plain modules and LoRA layers only.*'off'"):
        DenseMirror(ia3)
    prompt = get_peft_model(_model(tokenizer), PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4))
    with pytest.raises(ValueError, match="virtual tokens"):
        DenseMirror(prompt)


# ---- deciding ----------------------------------------------------------------------------------------

def test_auto_wants_the_mirror_to_fit_twice():
    gib = 2**30
    assert fits(4 * gib, 8 * gib)[0]
    ok, why = fits(4 * gib, 8 * gib - 1)
    assert not ok and "4.00 GiB" in why and "zero3_generation_mirror='on'" in why
    ok, why = fits(4 * gib, None)
    assert not ok and "CUDA" in why


def test_decide_off_on_and_auto_on_cpu(tokenizer):
    model = _model(tokenizer)
    assert decide("off", model, "auto", None) == (False, "zero3_generation_mirror='off'")
    assert decide("on", model, "hf", None)[0]  # forced: whatever the backend and memory
    on, why = decide("auto", model, "auto", None)  # no CUDA: the decoder that needs it does not run here
    assert not on and "CUDA" in why
    on, why = decide("auto", model, "hf", 2**40)
    assert not on and "generation_backend='hf'" in why
    assert decide("auto", model, "cuda_graph", 2**40)[0]


def test_on_with_a_model_the_mirror_cannot_copy_is_an_error(tokenizer):
    from peft import PromptTuningConfig, get_peft_model

    prompt = get_peft_model(_model(tokenizer), PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4))
    with pytest.raises(ValueError, match=r"zero3_generation_mirror='on'.*virtual tokens.*'auto' or 'off'"):
        decide("on", prompt, "auto", None)
    assert decide("auto", prompt, "auto", 2**40)[0] is False


def test_choose_is_none_without_zero3(tokenizer):
    model = _model(tokenizer)
    assert dense_mirror.choose("on", model, "auto", torch.device("cpu"), lambda v: v) is None


def _tagged_as_zero3(model):
    """Parameters marked as DeepSpeed marks them (not partitioned: choose() builds, it does not gather)."""
    for index, param in enumerate(model.parameters()):
        param.ds_id, param.ds_shape = index, param.shape
    return model


def test_choose_under_zero3(tokenizer, monkeypatch):
    model = _tagged_as_zero3(_model(tokenizer))
    cpu = torch.device("cpu")
    choice = dense_mirror.choose("on", model, "hf", cpu, lambda v: v)
    assert choice.mirror is not None and choice.plan_fields()["generation_mirror"] == "on"
    assert not dense_mirror.is_zero3_partitioned(choice.mirror.module)
    assert choice.nbytes == planned_nbytes(model) and "float64" in str(choice)
    assert dense_mirror.choose("auto", model, "auto", cpu, lambda v: v).mirror is None  # no CUDA
    assert "own copy" in dense_mirror.choose("on", model, "vllm", cpu, lambda v: v).reason

    # "auto" with room to spare keeps the copy only if the cuda_graph backend serves it (here: on CPU, it does not)
    asked = []
    monkeypatch.setattr(dense_mirror, "free_bytes", lambda device: 2**40)
    choice = dense_mirror.choose("auto", model, "auto", cpu, lambda v: asked.append(v) or v // 2)
    # the tightest rank decides, so every rank takes the same path; and whether every rank holds its partitions
    # whole (one process: read in place, no copy), which these tagged parameters do not
    assert asked == [2**40, 0]
    assert choice.mirror is None and "cuda_graph backend would not serve it" in choice.reason
    assert "cpu" in choice.reason


@pytest.mark.parametrize("release", [True, False], ids=["released", "kept"])
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_a_full_fine_tunes_mirror_is_freed_between_rollouts_when_generation_memory_is_released(tokenizer, release,
                                                                                                 lora):
    """Freed where that lowers the peak: a model training all its weights peaks in the training half; a LoRA run
    peaks in its rollouts, which hold the copy anyway, so it keeps it."""
    from types import SimpleNamespace

    model = _model(tokenizer, dtype=torch.bfloat16)
    model = _tagged_as_zero3(_lora(model) if lora else model)
    settings = SimpleNamespace(zero3_generation_mirror="on", lora_generation_mirror="auto", generation_backend="hf",
                               release_generation_memory=release)
    decided, choice = dense_mirror.choose_for_run(settings, model, True, torch.device("cpu"), lambda v: v, False)
    assert decided and isinstance(choice.mirror, DenseMirror)
    freed = release and not lora
    assert choice.freed_between_rollouts is freed
    assert choice.mirror.resident_nbytes == 0  # either way nothing is held before the first rollout's refresh
    assert choice.plan_fields()["generation_mirror_freed"] is freed
    assert ("freed after it (release_generation_memory)" in str(choice)) is freed
    assert ("a LoRA run peaks in its rollouts" in str(choice)) is (release and lora)
    assert ("kept between rollouts (release_generation_memory=False)" in str(choice)) is not release
    base = BatchPlan(per_device_train_batch_size=4, gradient_accumulation_steps=1, steps_per_generation=1,
                     num_generations=4, num_iterations=1, per_device_generation_batch_size=4, tensor_batch_size=None)
    line = str(BatchPlan(**{**base.__dict__, **choice.plan_fields()}))
    assert ("held during rollouts only (release_generation_memory)" in line) is freed
    assert ("held for the whole run" in line) is not freed


def test_config_rejects_an_unknown_mirror_setting(make_config):
    with pytest.raises(ValueError, match=r"zero3_generation_mirror must be one of \('auto', 'on', 'off'\), got 'yes'"):
        make_config(zero3_generation_mirror="yes")
    assert make_config().zero3_generation_mirror == "auto"
    assert make_config(zero3_generation_mirror="on").zero3_generation_mirror == "on"


def test_the_plan_says_whether_the_mirror_is_on_and_its_memory(tokenizer):
    base = BatchPlan(per_device_train_batch_size=4, gradient_accumulation_steps=1, steps_per_generation=1,
                     num_generations=4, num_iterations=1, per_device_generation_batch_size=4, tensor_batch_size=None)
    assert "mirror" not in str(base)  # not ZeRO-3: nothing to say
    model = _model(tokenizer, dtype=torch.bfloat16)
    choice = MirrorChoice(DenseMirror(model), "zero3_generation_mirror='on'")
    plan = BatchPlan(**{**base.__dict__, **choice.plan_fields()})
    assert choice.plan_fields()["generation_mirror_bytes"] == planned_nbytes(model)
    assert "dense mirror, one bfloat16 copy of the model per device" in str(plan)
    assert plan.to_dict()["generation_mirror"] == "on"
    off = BatchPlan(**{**base.__dict__, **MirrorChoice(None, "zero3_generation_mirror='off'").plan_fields()})
    assert "ZeRO-3: no dense mirror" in str(off)


# ---- ZeRO-3 (two processes) and CUDA -------------------------------------------------------------------

@pytest.fixture(scope="module", params=[2, 1], ids=["two_processes", "one_process"])
def zero3_mirror_runs(request, tmp_path_factory):
    """Both variants trained in turn in one launch: CPU processes under the shipped zero3.yaml; the script asserts
    the mirror path (see its docstring) and writes each variant's result.json."""
    processes = request.param
    out_dir = tmp_path_factory.mktemp(f"zero3_mirror_{processes}")
    command = accelerate_command("--config_file", ROOT / "accelerate_configs" / "zero3.yaml", "--mixed_precision", "no",
                                 ROOT / "tests" / "scripts" / "zero3_dense_mirror.py", out_dir, "plain", "lora-tied",
                                 processes=processes)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DIFFU_", "WORLD_SIZE", "RANK", "LOCAL_RANK"))}
    result = run_launch(command, processes=processes, timeout=900, cwd=ROOT, env=env)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-6000:]
    return out_dir, processes


@pytest.mark.slow
@pytest.mark.launch
@pytest.mark.parametrize("variant", ["plain", "lora-tied"])
def test_zero3_grpo_run_generates_from_a_layerwise_refreshed_mirror(zero3_mirror_runs, variant):
    out_dir, processes = zero3_mirror_runs
    found = json.loads((out_dir / variant / "result.json").read_text())
    assert found["mirror"] == "on"
    if processes == 2:  # a copy, refreshed from one gather a unit: embeddings, 2 decoder layers, final norm, and
        assert found["mirror_bytes"] > 0 and not found["in_place"]  # the head unless it is the embeddings' tensor
        # release_generation_memory (the default) frees the plain model's copy after each rollout; a LoRA run
        # keeps it (it peaks in its rollouts)
        assert found["freed_between_rollouts"] == (variant == "plain")
        assert ("held during rollouts only" in found["plan"]) == (variant == "plain")
        # at most one gather a unit: a unit whose parameters DeepSpeed keeps gathered (persistent) is read as it is
        assert found["gathers_per_refresh"] <= {"plain": 5, "lora-tied": 4}[variant]
        assert "decoded from a dense mirror" in found["plan"]
    else:  # the partitions read in place: no copy, and no gather (one process keeps every parameter gathered)
        assert found["mirror_bytes"] == 0 and found["in_place"] and not found["freed_between_rollouts"]
        assert found["gathers_per_refresh"] == 0
        assert "decoded from the partitions in place" in found["plan"]


def _cuda_graph_rollouts(tokenizer, rollouts: int, after_rollout=None):
    """``rollouts`` rollouts of a LoRA policy on CUDA decoded from its mirror by the cuda_graph backend, each equal
    to the eager decode of PEFT's merged model, an optimizer step after each; ``after_rollout(backend, mirror)`` runs
    between a rollout and its step. Returns the backend and the mirror."""
    from hf_grpo.generation.cuda_graph import CudaGraphBackend

    policy = _lora(_model(tokenizer, dtype=torch.float32).cuda())
    mirror = DenseMirror(policy)
    backend = CudaGraphBackend(compile=False)
    config = GenerationConfig(max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=1)
    prompts = [[5, 6, 7], [8, 9]]
    optimizer = torch.optim.SGD([p for p in policy.parameters() if p.requires_grad], lr=0.5)
    for _ in range(rollouts):
        mirror.refresh(policy)
        ours = backend.generate(mirror.module, prompts, generation_config=config, chunk_size=2, pad_token_id=0,
                                eos_token_ids=[1])
        merged = copy.deepcopy(policy).merge_and_unload()
        theirs = CudaGraphBackend(use_cuda_graph=False, compile=False).generate(
            merged, prompts, generation_config=config, chunk_size=2, pad_token_id=0, eos_token_ids=[1])
        assert ours == theirs
        del merged
        if after_rollout is not None:
            after_rollout(backend, mirror)
        policy.train()
        policy(_ids().cuda(), labels=_ids().cuda()).loss.backward()
        optimizer.step()
        policy.eval()
    return backend, mirror


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graph_on_the_mirror_is_captured_once_across_refreshes(tokenizer):
    backend, _ = _cuda_graph_rollouts(tokenizer, 2)
    assert backend.num_captures == 1  # the second rollout replayed the first capture on refreshed values


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graph_decodes_a_released_and_refilled_mirror_as_the_policy(tokenizer):
    """The trainer's default cycle on a GPU: refresh, decode (captured graph), free the decoder's memory and the
    mirror's, an optimizer step, then the next rollout captures again on the refilled copy."""
    freed = []

    def release(backend, mirror):
        backend.release(empty_cache=False)
        before = torch.cuda.memory_allocated()
        mirror.release()
        freed.append(before - torch.cuda.memory_allocated())

    backend, mirror = _cuda_graph_rollouts(tokenizer, 3, release)
    assert backend.num_captures == 3  # a capture a rollout, each on the refilled copy
    held = sum(p.numel() * p.element_size() for p in mirror.module.parameters())
    # each release gave the whole copy back to the allocator (which rounds every block up to 512 bytes)
    assert mirror.resident_nbytes == 0 and freed[0] >= held and freed == [freed[0]] * 3, (freed, held)
