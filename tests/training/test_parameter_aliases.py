"""hf_grpo.training.parameter_aliases: the views a backward under DeepSpeed is captured through give the parameters'
gradients, never reach their accumulation, and leave the model as it was (order, tied weights)."""

import torch

from hf_grpo.recipe_support.tiny import build_char_tokenizer, build_tiny_model
from hf_grpo.training.parameter_aliases import ParameterAliases


def test_views_give_the_parameters_gradients_and_leave_the_model_as_it_was():
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(tokenizer, seed=0)
    model.lm_head.weight = model.model.embed_tokens.weight  # tied, as many checkpoints are
    params = [p for p in model.parameters() if p.requires_grad]
    names_before = [name for name, _ in model.named_parameters()]
    ids = torch.tensor([[3, 5, 7, 9, 11]])
    expected = torch.autograd.grad(model(input_ids=ids).logits.square().sum(), params)
    accumulated = []
    for param in params:
        param.register_post_accumulate_grad_hook(lambda p: accumulated.append(p))
    aliases = ParameterAliases(model, params)
    with aliases.swapped() as views:
        assert not any(isinstance(v, torch.nn.Parameter) for v in views)
        tied = model.lm_head.weight  # one view in both places
        assert tied is model.model.embed_tokens.weight and not isinstance(tied, torch.nn.Parameter)
        got = torch.autograd.grad(model(input_ids=ids).logits.square().sum(), views)
    assert accumulated == [] and all(p.grad is None for p in params)
    for want, have in zip(expected, got):
        torch.testing.assert_close(have, want)
    assert [name for name, _ in model.named_parameters()] == names_before
    assert model.lm_head.weight is model.model.embed_tokens.weight and isinstance(model.lm_head.weight,
                                                                                torch.nn.Parameter)
