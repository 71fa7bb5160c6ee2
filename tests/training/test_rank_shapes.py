"""Two ranks over gloo build their micro-batches in one static shape (hf_grpo.training.rank_shapes), so that under
DDP they capture the same CUDA graphs at the same call; each rank's log-probs stay its own micro-batch's."""

import pytest
import torch
import torch.multiprocessing as mp
from tests.launching import gloo_group, join_ranks, spawn_ranks
from tests.side_by_side import free_port
from tests.training.test_training_compile import batch
from tests.training.test_training_graphs import checkpointed_model

from hf_grpo.training import graph_inputs, rank_shapes

# rank 0's micro-batch is short, rank 1's long: on their own they would be built in different shapes
SHAPES = {0: dict(prompt=11, completion=6, seed=0), 1: dict(prompt=70, completion=90, seed=40)}


def _scored(model, built):
    """The log-probs a graph of ``built`` gives, in TRL's layout (as graphs.replay's ``score``)."""
    out = model(**graph_inputs.model_kwargs(built.inputs, built.window))
    return built.spread(out.log_probs[:, -built.window:])


def _worker(rank, port, results):
    with gloo_group(rank, port, world_size=2):
        model = checkpointed_model()
        ids, mask, labels = batch(3, **SHAPES[rank])
        width = SHAPES[rank]["completion"]
        got = {}
        with torch.no_grad():
            expected = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True).log_probs
            expected = expected[:, -width:]
            for packed in (False, True):
                own = rank_shapes.static_batch(model, ids, mask, width, 0, packed=packed, over_ranks=False)
                agreed = rank_shapes.static_batch(model, ids, mask, width, 0, packed=packed, over_ranks=True)
                logps = _scored(model, agreed)
                got[packed] = dict(own=(own.key, own.window), agreed=(agreed.key, agreed.window),
                                   same=torch.allclose(logps, expected, rtol=1e-5, atol=1e-6))
            # rank 1's capture failed (it scores eagerly): it joins the agreement without a batch of its own
            if rank == 1:
                rank_shapes.join_without_a_batch()
            else:
                alone = rank_shapes.static_batch(model, ids, mask, width, 0, packed=False, over_ranks=True)
                got["alone"] = (alone.key, alone.window) == got[False]["own"]
            # a row rank 1 cannot pack (an empty one) sends both ranks' micro-batches padded
            if rank == 1:
                mask[0] = 0
            either = rank_shapes.static_batch(model, ids, mask, width, 0, packed=True, over_ranks=True)
            got["unpackable"] = either.key[0]
        results[rank] = got


@pytest.mark.slow
@pytest.mark.launch
def test_two_ranks_build_their_micro_batches_in_one_shape_and_keep_their_own_log_probs():
    results = mp.Manager().dict()
    hung = join_ranks(spawn_ranks(_worker, (free_port(), results), processes=2), timeout=120)
    assert not hung, "a rank hung waiting for the other"
    assert sorted(results.keys()) == [0, 1], "a rank failed: see its traceback above"
    first, second = results[0], results[1]
    for packed in (False, True):
        assert first[packed]["own"] != second[packed]["own"], "the ranks' own shapes must differ for the test to mean"
        assert first[packed]["agreed"] == second[packed]["agreed"] == second[packed]["own"], (packed, first, second)
        assert first[packed]["same"] and second[packed]["same"], (packed, first, second)
    assert first[True]["agreed"][0][0] == "packed" and first[False]["agreed"][0][0] == "padded"
    assert first["alone"] is True  # a failed rank adds nothing: rank 0 keeps its own shape
    assert first["unpackable"] == second["unpackable"] == "padded"
