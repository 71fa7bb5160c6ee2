"""BatchPlan arithmetic and rules, checked against the formulas of the README's batch-size section."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_grpo.plan import BatchPlan


def plan(P=4, A=1, S=1, G=4, mu=1, g=None, t=1024, W=1):
    return BatchPlan(P, A, S, G, mu, P * S if g is None else g, t, W)


def test_example_from_the_contract_renders_the_tree():
    text = str(plan(P=16, A=4, S=4, G=8, g=8, t=1024, W=8).validate())
    assert text == (
        "rollout: 64 prompts x 8 generations = 512 completions (64 per device x 8 devices)\n"
        "├── generation: 64 per device in 8 chunks of 8 (per_device_generation_batch_size)\n"
        "├── training: 4 micro-batches of 16 per device (per_device_train_batch_size)\n"
        "│   └── optimizer step every 4 micro-batches: 16 x 4 x 8 devices = 512 completions\n"
        "├── 1 optimizer step per rollout, 1 pass (num_iterations)\n"
        "└── log-softmax in chunks of 1024 token rows (tensor_batch_size)"
    )


def test_rendering_of_uneven_chunks_several_steps_and_no_tensor_chunking():
    text = str(plan(P=2, A=1, S=3, G=2, mu=2, g=4, t=None))
    assert "6 per device in 2 chunks of 4 (the last of 2)" in text
    assert "6 optimizer steps per rollout, 2 passes" in text
    assert "log-softmax over all token rows at once" in text
    assert "1 optimizer step per 2 rollouts" in str(plan(P=2, A=4, S=2, G=2))


@st.composite
def steps_and_accumulation(draw):
    """(S, A) with one dividing the other, as the contract requires."""
    A = draw(st.integers(1, 16))
    if draw(st.booleans()):
        return A * draw(st.integers(1, 8)), A
    return draw(st.sampled_from([d for d in range(1, A + 1) if A % d == 0])), A


@settings(max_examples=300, deadline=None)
@given(
    P=st.integers(1, 64),
    SA=steps_and_accumulation(),
    G=st.integers(2, 16),
    mu=st.integers(1, 4),
    W=st.integers(1, 16),
    g_frac=st.floats(0.01, 1.0),
    t=st.one_of(st.none(), st.integers(1, 8192)),
)
def test_derived_figures_follow_the_formulas(P, SA, G, mu, W, g_frac, t):
    S, A = SA
    R = P * S
    g = max(1, int(R * g_frac))
    p = BatchPlan(P, A, S, G, mu, g, t, W)
    valid = (R * W) % G == 0
    assert (p.problems() == []) == valid
    assert p.rollout_per_device == R
    assert p.global_rollout == R * W
    assert p.global_batch_size == P * A * W
    assert p.optimizer_steps_per_rollout * A == S * mu
    assert p.generation_chunks == math.ceil(R / g)
    assert (p.generation_chunks - 1) * g + p.last_generation_chunk == R
    assert 0 < p.last_generation_chunk <= g
    if valid:
        assert p.prompts_per_rollout * G == R * W
        assert p.logprob_chunks(1000) == (1 if t is None else math.ceil(1000 / t))
        assert p.to_dict()["global_rollout"] == R * W


@pytest.mark.parametrize(
    "kwargs, expected",
    [
        (dict(P=0), ["per_device_train_batch_size must be an integer >= 1, got 0"]),
        (dict(G=1), ["num_generations must be an integer >= 2, got 1"]),
        (dict(A=-1), ["gradient_accumulation_steps must be an integer >= 1, got -1"]),
        (dict(t=0), ["tensor_batch_size must be an integer >= 1 or None for no chunking, got 0"]),
        (dict(g=0), ["per_device_generation_batch_size must be an integer >= 1, got 0"]),
        (dict(W=0), ["world size must be an integer >= 1, got 0"]),
        (dict(mu=0), ["num_iterations must be an integer >= 1, got 0"]),
    ],
)
def test_each_size_must_be_positive(kwargs, expected):
    with pytest.raises(ValueError) as err:
        plan(**kwargs).validate()
    for text in expected:
        assert text in str(err.value)


def test_whole_prompt_groups_rule_names_values_and_nearest_fix():
    problems = plan(P=3, S=1, G=8).problems()
    assert len(problems) == 1
    assert "per_device_train_batch_size (3) x steps_per_generation (1) x world size (1) = 3" in problems[0]
    assert "num_generations (8)" in problems[0]
    assert "nearest valid per_device_train_batch_size: 8" in problems[0]
    # with 2 devices, 4 and 8 are the nearest per-device sizes that give whole groups of 8
    assert "nearest valid per_device_train_batch_size: 4" in plan(P=3, G=8, W=2).problems()[0]


def test_rollout_must_cover_whole_optimizer_steps():
    problems = plan(P=1, S=6, A=4, G=2).problems()
    assert len(problems) == 1
    assert "steps_per_generation (6) and gradient_accumulation_steps (4)" in problems[0]
    assert "nearest valid steps_per_generation: 4 or 8" in problems[0]
    assert plan(P=1, S=2, A=4, G=2).problems() == []  # A multiple of S: one step spans 2 rollouts
    assert plan(P=1, S=8, A=4, G=2).problems() == []


def test_generation_chunk_larger_than_rollout_is_rejected_and_points_at_trl_field():
    problems = plan(P=4, S=2, G=4, g=9, W=2).problems()
    assert len(problems) == 1
    assert "per_device_generation_batch_size (9)" in problems[0]
    assert "= 8 completions; nearest valid: 8" in problems[0]
    assert "generation_batch_size is the global rollout (16 here)" in problems[0]


def test_all_problems_are_reported_together():
    with pytest.raises(ValueError) as err:
        plan(P=3, S=3, A=2, G=4, g=20).validate()
    message = str(err.value)
    assert message.count("\n  - ") == 3


def test_plan_module_does_not_import_torch():
    import subprocess
    import sys

    import hf_grpo.plan

    # Load plan.py on its own: the package __init__ imports the config, which needs torch.
    script = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('plan', {hf_grpo.plan.__file__!r})\n"
        "module = importlib.util.module_from_spec(spec); sys.modules['plan'] = module\n"
        "spec.loader.exec_module(module)\n"
        "assert 'torch' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True)
