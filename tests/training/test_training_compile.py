"""Compiled training layers (hf_grpo.training.compiled_layers): the same log-probs and gradients as eager, activation
checkpointing's recompute included, and a bounded number of compiles over micro-batches of changing shape."""

import copy
import functools

import pytest
import torch

from hf_grpo.training import compiled_layers as training_compile
from hf_grpo.logprob_head import install_chunked_lm_head
from hf_grpo.run_state.facts import RunFacts
from hf_grpo.recipe_support.tiny import build_char_tokenizer, build_tiny_model


@pytest.fixture(autouse=True)
def fresh_compile_cache():
    """torch.compile's cache is kept per function, whatever the backend: each test compiles (and counts, or fails
    to compile) on its own, whichever tests ran before it."""
    torch._dynamo.reset()


def batch(rows: int, prompt: int, completion: int, seed: int):
    """Left-padded prompts and right-padded completions of varied length, with TRL's labels."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, 40, (rows, prompt + completion), generator=gen)
    mask = torch.zeros_like(ids)
    for row in range(rows):
        p = 1 + (row * 3 + seed) % prompt
        c = 1 + (row * 5 + seed) % completion
        mask[row, prompt - p:prompt + c] = 1
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :prompt] = -100
    return ids, mask, labels


def forward_backward(model, ids, mask, labels):
    model.zero_grad()
    out = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
    (out.log_probs.sum() + out.entropy.sum()).backward()
    return out.log_probs.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def checkpointed_pair(padding_free: bool = False, device: str = "cpu", **model_overrides):
    """A tiny model training with activation checkpointing, and its copy to route through compiled layers."""
    eager = build_tiny_model(build_char_tokenizer(), attn_implementation="sdpa", **model_overrides).to(device)
    eager.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    eager.train()
    compiled_model = copy.deepcopy(eager)
    for model in (eager, compiled_model):
        install_chunked_lm_head(model, temperature=1.0, chunk_rows=7, return_entropy=True,
                                padding_free_rows=padding_free)
    return eager, compiled_model


def assert_compiled_equals_eager(eager, compiled_model, layers, inputs, rtol=1e-5, atol=1e-6, grad_rtol=1e-5):
    expected_logps, expected_grads = forward_backward(eager, *inputs)
    with layers.route(compiled_model):
        logps, grads = forward_backward(compiled_model, *inputs)
    torch.testing.assert_close(logps, expected_logps, rtol=rtol, atol=atol)
    assert grads.keys() == expected_grads.keys()
    for name, grad in expected_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=grad_rtol, atol=atol, msg=name)


@pytest.mark.parametrize("padding_free", [False, True], ids=["padded", "packed"])
def test_compiled_layers_equal_eager_and_compile_a_bounded_number_of_times(padding_free):
    eager, compiled_model = checkpointed_pair(padding_free)
    layers = training_compile.CompiledTrainingLayers(backend="aot_eager_decomp_partition")  # as inductor partitions
    shapes = [(4, 6, 5), (3, 9, 4), (5, 4, 7), (2, 8, 8)] * 2  # rows, prompt width, completion width; twice
    compiles = []
    for seed, shape in enumerate(shapes):
        assert_compiled_equals_eager(eager, compiled_model, layers, batch(*shape, seed=seed))
        compiles.append(layers.compiles)
    # Dynamic shapes: a new shape compiles at most once more (torch 2.13 compiles none; 2.11 one per shape here),
    # and shapes seen once compile nothing again, however the batches come.
    assert compiles[0] > 0 and compiles[3] <= compiles[0] + 3 and compiles[-1] == compiles[3], compiles
    # Outside the block the layers run their own forward again.
    assert all("forward" not in vars(layer) for layer in compiled_model.model.layers)


def test_the_cpp_wrapper_setting_compiles_every_graph_with_inductors_cpp_wrapper(monkeypatch):
    """compile_training="cpp_wrapper": inductor's compile_fx with its cpp_wrapper option, which it applies to the
    forward's and the backward's compiles (a real inductor build is the GPU test below; on this CPU it takes
    ~40 s). Here compile_fx partitions as inductor does, so the layers still equal eager."""
    from torch._inductor import compile_fx as compile_fx_module

    patches = []
    partitioning = torch._dynamo.lookup_backend("aot_eager_decomp_partition")

    def compile_fx(graph, example_inputs, config_patches=None):
        patches.append(config_patches)
        return partitioning(graph, example_inputs)

    monkeypatch.setattr(compile_fx_module, "compile_fx", compile_fx)
    eager, compiled_model = checkpointed_pair()
    layers, why = training_compile.choose("cpp_wrapper", [compiled_model], torch.device("cuda"), None, 10)
    assert layers is not None and layers.cpp_wrapper and not layers.eager_on_failure, why
    assert_compiled_equals_eager(eager, compiled_model, layers, batch(4, 6, 5, seed=0))
    assert patches and patches == [{"cpp_wrapper": True}] * layers.compiles
    assert not training_compile.choose("on", [compiled_model], torch.device("cuda"), None, 10)[0].cpp_wrapper
    with pytest.raises(ValueError, match=r"cpp_wrapper is an option of the inductor backend, not of 'aot_eager'"):
        training_compile.CompiledTrainingLayers(backend="aot_eager", cpp_wrapper=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("cpp_wrapper", [False, True], ids=["python_wrapper", "cpp_wrapper"])
def test_inductor_compiled_layers_equal_eager_on_the_gpu_with_checkpointing(cpp_wrapper):
    """What the trainer runs on a GPU: inductor's kernels, the compiler's own activation checkpointing."""
    eager, compiled_model = checkpointed_pair(device="cuda", hidden_size=128, intermediate_size=512)
    layers = training_compile.CompiledTrainingLayers(cpp_wrapper=cpp_wrapper)
    for seed, shape in enumerate([(4, 40, 24), (3, 17, 9), (4, 40, 24)]):
        inputs = [t.cuda() for t in batch(*shape, seed=seed)]
        assert_compiled_equals_eager(eager, compiled_model, layers, inputs, rtol=1e-4, atol=1e-4, grad_rtol=1e-3)
    assert 0 < layers.compiles <= 6, layers.compiles


def saved_for_backward_mib(model, ids, mask, labels) -> float:
    """MiB of memory that autograd keeps for backward over one forward of ``model``, parameters aside
    (a compiled graph saves references to the weights it reads; they take no memory of their own)."""
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
    (out.log_probs.sum() + out.entropy.sum()).backward()
    return sum(saved.values()) / 2**20


def test_checkpointing_is_done_inside_the_graph_so_compile_caches_serve_it():
    """Traced through transformers' checkpointing wrapper, the checkpoint became a higher-order op in the graph,
    which torch's compile caches refuse: every run compiled again. The layer's own forward is compiled instead,
    with the partitioner told to recompute what it can: a checkpointed layer keeps little more for backward
    than checkpointing does, and far less than the same compiled layer without checkpointing."""
    model = build_tiny_model(build_char_tokenizer(), attn_implementation="sdpa", hidden_size=128,
                             intermediate_size=512)
    model.train()
    install_chunked_lm_head(model, temperature=1.0, chunk_rows=7, return_entropy=True)
    inputs = batch(4, 48, 48, seed=0)
    graphs = []

    def partitioning(graph, example_inputs):
        graphs.append(graph)
        return torch._dynamo.lookup_backend("aot_eager_decomp_partition")(graph, example_inputs)

    layers = training_compile.CompiledTrainingLayers(backend=partitioning)
    with layers.route(model):
        kept_without = saved_for_backward_mib(model, *inputs)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    eager_checkpointed = saved_for_backward_mib(model, *inputs)
    with layers.route(model):
        kept_with = saved_for_backward_mib(model, *inputs)
    assert graphs, "nothing was compiled"
    targets = {str(node.target) for graph in graphs for node in graph.graph.nodes}
    assert not any("checkpoint" in target for target in targets), sorted(targets)
    assert kept_with < 0.35 * kept_without, (kept_with, kept_without)
    assert kept_with < 1.25 * eager_checkpointed, (kept_with, eager_checkpointed)


def test_without_a_partitioner_memory_budget_the_checkpoint_runs_eagerly_around_the_compiled_layer(monkeypatch):
    """On a torch whose partitioner takes no memory budget, checkpointed layers still compile, equal to eager,
    with transformers' checkpoint around them: the layer runs compiled in forward and again in the recompute."""
    monkeypatch.setattr(training_compile, "compiler_checkpointing_available", lambda: False)
    eager, compiled_model = checkpointed_pair()
    runs = []

    def counting(graph, example_inputs):
        def run(*args):
            runs.append(1)
            return graph.forward(*args)

        return run

    layers = training_compile.CompiledTrainingLayers(backend=counting)
    assert_compiled_equals_eager(eager, compiled_model, layers, batch(3, 5, 4, seed=0))
    assert len(runs) == 2 * len(compiled_model.model.layers)  # the forward, and the recompute in backward


def failing_backend(graph, example_inputs):
    raise RuntimeError("this backend cannot compile the layer")


def test_auto_goes_on_eagerly_when_torch_cannot_compile_the_layers(caplog):
    """compile_training='auto' was the trainer's choice, not the user's: a layer that does not compile costs a
    warning, and the step's numbers are eager's."""
    eager, compiled_model = checkpointed_pair()
    layers = training_compile.CompiledTrainingLayers(backend=failing_backend, eager_on_failure=True)
    with caplog.at_level("WARNING", logger="hf_grpo"):
        assert_compiled_equals_eager(eager, compiled_model, layers, batch(3, 5, 4, seed=0))
        assert_compiled_equals_eager(eager, compiled_model, layers, batch(2, 6, 3, seed=1))
    assert layers.failure is not None and "cannot compile the layer" in layers.failure
    warnings = [r.getMessage() for r in caplog.records if "could not compile" in r.getMessage()]
    assert len(warnings) == 1 and "Qwen2DecoderLayer" in warnings[0], warnings


def test_compile_training_on_raises_when_torch_cannot_compile_the_layers():
    _, compiled_model = checkpointed_pair()
    layers = training_compile.CompiledTrainingLayers(backend=failing_backend)
    with layers.route(compiled_model), pytest.raises(torch._dynamo.exc.BackendCompilerFailed):
        forward_backward(compiled_model, *batch(3, 5, 4, seed=0))


def test_choose_lets_only_auto_fall_back_to_eager():
    model = build_tiny_model(build_char_tokenizer())
    auto, _ = training_compile.choose("auto", [model], torch.device("cuda"), None, 1000)
    on, _ = training_compile.choose("on", [model], torch.device("cuda"), None, 1000)
    assert auto.eager_on_failure and not on.eager_on_failure


def test_suspended_layers_run_their_own_forward():
    model = build_tiny_model(build_char_tokenizer())
    layers = training_compile.CompiledTrainingLayers(backend="eager")
    with layers.route(model):
        assert all("forward" in vars(layer) for layer in model.model.layers)
        with layers.suspended():
            assert all("forward" not in vars(layer) for layer in model.model.layers)
        assert all("forward" in vars(layer) for layer in model.model.layers)


@pytest.mark.parametrize(
    ("setting", "device", "sharded", "steps", "reason"),
    [
        ("off", "cuda", None, 1000, "compile_training='off'"),
        ("auto", "cpu", None, 1000, "compiles on CUDA only"),
        ("auto", "cuda", None, 20, "this run has 20: set 'on' to compile"),
        # the sharding is named first: a short run under ZeRO-3 or FSDP is not told that "on" would compile it
        ("on", "cuda", "ZeRO-3", 1000, "ZeRO-3 without its decoder layers as leaf modules (zero3_leaf_modules='off')"),
        ("auto", "cuda", "ZeRO-3", 20, "ZeRO-3 without its decoder layers as leaf modules"),
        ("auto", "cpu", "FSDP", 1000, "FSDP shards the parameters"),
        ("on", "cuda", "FSDP", 1000, "FSDP shards the parameters"),
    ],
)
def test_choose_says_why_not(setting, device, sharded, steps, reason):
    model = build_tiny_model(build_char_tokenizer())
    chosen, why = training_compile.choose(setting, [model], torch.device(device), sharded, steps)
    assert chosen is None and reason in why


def test_under_zero3_with_leaf_layers_on_compiles_on_the_cpu_and_never_on_a_gpu():
    # ZeRO-3 gathers a leaf module's parameters in one hook around its forward, which runs the compiled layer: the
    # two train alike on the CPU (tests/distributed/test_packed_launch.py), not on a GPU, where the layers stay eager.
    from deepspeed.utils import set_z3_leaf_modules

    model = build_tiny_model(build_char_tokenizer())
    reference = build_tiny_model(build_char_tokenizer())
    set_z3_leaf_modules(model, [type(model.model.layers[0])])
    chosen, why = training_compile.choose("on", [model], torch.device("cpu"), "ZeRO-3", 1000)
    assert isinstance(chosen, training_compile.CompiledTrainingLayers) and why is None
    for setting in ("on", "auto", "cpp_wrapper"):
        assert training_compile.choose(setting, [model], torch.device("cuda"), "ZeRO-3", 1000) == (
            None, training_compile.ZERO3_CUDA_REASON)
    chosen, why = training_compile.choose("on", [model, reference], torch.device("cpu"), "ZeRO-3", 1000)
    assert chosen is None and "without its decoder layers as leaf modules" in why  # the reference's are not


def test_zero3_with_one_process_compiles_on_the_cpu_and_not_yet_on_a_gpu():
    # One process removes DeepSpeed's hooks (no sharding left to name): its compiled layers train as eager ones on
    # the CPU (tests/distributed/test_packed_launch.py); on a GPU they stay eager until checked there.
    model = build_tiny_model(build_char_tokenizer())
    chosen, why = training_compile.choose("on", [model], torch.device("cpu"), None, 1000, zero3_one_process=True)
    assert isinstance(chosen, training_compile.CompiledTrainingLayers) and why is None
    assert training_compile.choose("on", [model], torch.device("cuda"), None, 1000, zero3_one_process=True) == (
        None, training_compile.ZERO3_CUDA_REASON)
    # what the trainer hands over: the run's facts, one process under ZeRO-3 with its hooks removed
    facts = RunFacts(device_type="cuda", deepspeed=True, zero3=True, zero3_hooks_removed=True)
    assert training_compile.choose_logged("on", [model], torch.device("cuda"), facts, 1000, main=False) is None
    facts = RunFacts(device_type="cuda", deepspeed=True)  # ZeRO-2: compiles
    assert training_compile.choose_logged("on", [model], torch.device("cuda"), facts, 1000, main=False) is not None


@pytest.mark.parametrize(("setting", "steps"), [("auto", training_compile.AUTO_MIN_STEPS), ("on", 5)])
def test_choose_compiles_long_cuda_runs_and_whatever_on_asks(setting, steps):
    model = build_tiny_model(build_char_tokenizer())
    chosen, why = training_compile.choose(setting, [model], torch.device("cuda"), None, steps)
    assert isinstance(chosen, training_compile.CompiledTrainingLayers) and why is None


def test_bad_setting_is_named(make_config):
    with pytest.raises(ValueError, match=r"compile_training must be one of \['auto', 'on', 'cpp_wrapper', 'off'\], got 'yes'"):
        make_config(compile_training="yes")


@pytest.mark.slow
def test_an_explicit_pad_to_multiple_of_wins_over_the_alignment_for_compiled_layers(tmp_path, make_config):
    import hf_grpo
    from datasets import Dataset

    from hf_grpo.recipe_support.tiny import build_char_tokenizer, build_tiny_model

    tokenizer = build_char_tokenizer()
    for given, expected in (({}, 8), ({"pad_to_multiple_of": None}, None), ({"pad_to_multiple_of": 64}, 64)):
        trainer = hf_grpo.GRPOTrainer(
            model=build_tiny_model(tokenizer), processing_class=tokenizer,
            args=make_config(compile_training="on", **given), reward_funcs=lambda completions, **kw: [0.0] * len(completions),
            train_dataset=Dataset.from_dict({"prompt": ["ab>"] * 8}))
        compiled = training_compile.CompiledTrainingLayers(backend="eager")
        trainer._compiled_training_layers = lambda steps: compiled  # as train begin decides on CUDA
        trainer._begin_run(1, False)
        assert trainer.pad_to_multiple_of == expected, given


def test_grpo_run_with_compiled_layers_updates_as_eager(tmp_path, monkeypatch):
    # A whole run from a saved checkpoint with a reference model and activation checkpointing: compiled layers give
    # the eager updates, a bounded number of compiles is logged, and generation never sees the compiled layers.
    import hf_grpo
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_grpo.generation.hf import HFGenerateBackend
    from hf_grpo.recipe_support.tiny import save_tiny_checkpoint

    checkpoint = save_tiny_checkpoint(tmp_path / "checkpoint")
    init = training_compile.CompiledTrainingLayers.__init__  # the trainer's layers compile without codegen here
    monkeypatch.setattr(training_compile.CompiledTrainingLayers, "__init__",
                        functools.partialmethod(init, backend="aot_eager_decomp_partition"))
    generate = HFGenerateBackend.generate
    routed_during_generation = []

    def watched_generate(self, model, prompt_ids, **kwargs):
        routed_during_generation.append(any("forward" in vars(layer) for layer in model.model.layers))
        return generate(self, model, prompt_ids, **kwargs)

    monkeypatch.setattr(HFGenerateBackend, "generate", watched_generate)
    scored_lengths = []  # sequence length of every scoring / training forward
    score = hf_grpo.GRPOTrainer._get_per_token_logps_and_entropies

    def watched_score(self, model, input_ids, *args, **kwargs):
        scored_lengths.append(input_ids.shape[1])
        return score(self, model, input_ids, *args, **kwargs)

    monkeypatch.setattr(hf_grpo.GRPOTrainer, "_get_per_token_logps_and_entropies", watched_score)

    def run(compile_training):
        scored_lengths.clear()
        torch.manual_seed(0)
        config = hf_grpo.GRPOConfig(
            output_dir=str(tmp_path / compile_training), report_to=[], use_cpu=True, bf16=False, max_steps=2,
            seed=0, per_device_train_batch_size=4, gradient_accumulation_steps=1, num_generations=4,
            max_completion_length=5, learning_rate=0.01, optim="sgd", max_grad_norm=0.0, logging_steps=1,
            save_strategy="no", disable_tqdm=True, generation_backend="hf", beta=0.04,
            activation_checkpointing=True, compile_training=compile_training, temperature=0.7)
        trainer = hf_grpo.GRPOTrainer(
            model=AutoModelForCausalLM.from_pretrained(checkpoint), args=config,
            processing_class=AutoTokenizer.from_pretrained(checkpoint, padding_side="left"),
            reward_funcs=lambda completions, **kw: [float(sum(map(ord, c)) % 7) for c in completions],
            train_dataset=Dataset.from_dict({"prompt": ["ab>", "c>", "defgh>", "ij>"] * 4}))
        trainer.train()
        params = torch.cat([p.detach().flatten() for p in trainer.model.parameters()])
        return params, trainer

    eager_params, eager = run("off")
    assert any(length % 8 for length in scored_lengths), "the prompts would be aligned anyway: the test proves nothing"
    compiled_params, trainer = run("on")
    assert scored_lengths and all(length % 8 == 0 for length in scored_lengths), scored_lengths
    assert trainer.decisions.train_layers is not None and trainer.get_performance_stats()["train_compiles"] > 0
    # compiled, lengths are padded to multiples of 8 (one variant of inductor's attention); eager, as TRL pads
    assert (trainer.pad_to_multiple_of, eager.pad_to_multiple_of) == (8, None)
    assert routed_during_generation and not any(routed_during_generation)
    torch.testing.assert_close(compiled_params, eager_params, rtol=1e-5, atol=1e-6)


def test_compiled_layers_serve_the_packed_rows_a_training_graph_replays():
    # The packed static form (training graphs with padding_free): row bounds and window index are tensors, so one
    # dynamic compile serves every packed length; each equals the eager static form.
    from hf_grpo.training import graph_inputs

    eager, compiled_model = checkpointed_pair()
    layers = training_compile.CompiledTrainingLayers(backend="aot_eager_decomp_partition")

    def logps_and_grads(model, inputs, window):
        model.zero_grad()
        out = model(**graph_inputs.model_kwargs(inputs, window))
        (out.log_probs.sum() + out.entropy.sum()).backward()
        return out.log_probs.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    compiles = []
    for seed, shape in enumerate([(4, 6, 5), (3, 30, 4), (5, 4, 7), (4, 6, 5)]):
        ids, mask, _ = batch(*shape, seed=seed)
        _, inputs, window, _ = graph_inputs.packed(eager, ids, mask, shape[2], pad_token_id=0)
        expected_logps, expected_grads = logps_and_grads(eager, inputs, window)
        with layers.route(compiled_model):
            logps, grads = logps_and_grads(compiled_model, inputs, window)
        torch.testing.assert_close(logps, expected_logps, rtol=1e-5, atol=1e-6)
        assert grads.keys() == expected_grads.keys()
        for name, grad in expected_grads.items():
            torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)
        compiles.append(layers.compiles)
    assert compiles[0] > 0 and compiles[-1] <= compiles[0] + 3, compiles
