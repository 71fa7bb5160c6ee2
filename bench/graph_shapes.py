"""How many CUDA-graph shapes a run meets, and how much LM-head work each micro-batch does: a simulation.

A training graph is captured once per shape and replayed after, so the number of shapes a run meets, and how
early, sets how much of it goes to captures (a capture costs about one eager micro-batch: docs/performance.md).
This draws the rollouts of ``grpo_realistic.py`` (prompts uniform in a range, 8 completions a prompt ending on
EOS with probability ``--eos_prob`` a token, capped) and runs TRL's batching (32 rows a rollout, shuffled into
4 training micro-batches of 8; the reference scored 16 rows at a time, unshuffled) through the trainer's own
``TrainingGraphs.static_inputs``. No GPU and no model run: only shapes are counted.

For each micro-batch it records the shape the graphs replay it in, with the tokens the layers and the head run
over, in three layouts:

* ``current``: the trainer's (packed length in four buckets an octave, scored width), a new shape's first
  micro-batches replayed in a captured larger one (``hf_grpo.training.shape_reuse``, with the capture cost
  ``--reuse_capture_cost`` sets; the LM head weighed as in Qwen2.5 of the shape's size);
* ``no_reuse``: the same, every new shape captured at its first micro-batch;
* ``before``: packed length in eight buckets an octave and the bucket of the rollout's longest completion, whose
  every position the head scored (the layout until ``3ea29c3``).

Each layout's ``shapes`` and ``captures_by_step`` count the shapes captured; ``reused`` counts the micro-batches
replayed in a larger shape; ``work_mean`` is the layers' tokens plus the head's weighed positions per training
micro-batch (``ShapeReuse.work``), as replayed and as the micro-batch's own shape.

    python bench/graph_shapes.py --steps 500 --out bench/results/raw/graph_shapes.jsonl
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random
import statistics
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from provenance import with_provenance  # noqa: E402

from hf_grpo.recipe_support.tiny import build_char_tokenizer, build_tiny_model  # noqa: E402
from hf_grpo.training import padding_free  # noqa: E402
from hf_grpo.training.graph_inputs import bucket  # noqa: E402
from hf_grpo.training.graphs import TrainingGraphs  # noqa: E402
from hf_grpo.training.shape_reuse import CAPTURE_COST, Shape, ShapeReuse  # noqa: E402

SHAPES = {  # grpo_realistic.py's two shapes: prompt token range, max_completion_length, and the model's head_share
    "0.5b": ((32, 384), 256, 0.38),  # Qwen2.5-0.5B: a 896 x 151,936 head over 358M weights in its layers
    "1.5b": ((64, 1024), 512, 0.18),  # Qwen2.5-1.5B: 1,536 x 151,936 over 1.31B
}


def rollout(rng: random.Random, prompts: tuple[int, int], cap: int, eos_prob: float, num_prompts: int = 4,
            generations: int = 8):
    """One rollout's padded ``(input_ids, attention_mask, completion_width)``, rows grouped by prompt."""
    prompt_lens = [rng.randint(*prompts) for _ in range(num_prompts)]
    rows = []
    for prompt in prompt_lens:
        for _ in range(generations):
            completion = 1
            while completion < cap and rng.random() >= eos_prob:
                completion += 1
            rows.append((prompt, completion))
    width_p, width_c = max(p for p, _ in rows), max(c for _, c in rows)
    mask = torch.zeros(len(rows), width_p + width_c, dtype=torch.long)
    for i, (prompt, completion) in enumerate(rows):
        mask[i, width_p - prompt:width_p + completion] = 1
    return torch.where(mask.bool(), 5, 0), mask, width_c


def simulate(shape: str, steps: int, eos_prob: float, seed: int, per_step_rows: int = 32, micro_rows: int = 8,
             scoring_rows: int = 16, capture_cost: float = CAPTURE_COST, group_prompts: bool = True):
    rng = random.Random(seed)
    model = build_tiny_model(build_char_tokenizer())  # only its config is read (no sliding window)
    prompts, cap, head_share = SHAPES[shape]
    reuse = ShapeReuse(head_share, capture_cost)
    graphs = TrainingGraphs(model, pad_token_id=0, packed=True, reuse=reuse)
    seen = {"current": set(), "no_reuse": set(), "before": set()}
    new_per_step = {name: [] for name in seen}
    head = {"current": [], "no_reuse": [], "before": [], "scored_tokens": []}
    layers = {"current": [], "no_reuse": [], "before": [], "real_tokens": []}
    work = {"current": [], "no_reuse": []}
    for _ in range(steps):
        ids, mask, width = rollout(rng, prompts, cap, eos_prob, num_prompts=per_step_rows // 8)
        order = list(range(ids.shape[0]))
        rng.shuffle(order)  # TRL's shuffle (drawn either way, so both settings see the same rollouts)
        if group_prompts:  # a prompt's rows in the same micro-batches (hf_grpo.training.prompt_groups)
            order = sorted(order, key=lambda row: row // 8)
        batches = [("score", ids[s:s + scoring_rows], mask[s:s + scoring_rows])
                   for s in range(0, ids.shape[0], scoring_rows)]
        batches += [("train", ids[order[s:s + micro_rows]], mask[order[s:s + micro_rows]])
                    for s in range(0, ids.shape[0], micro_rows)]
        before = {name: len(keys) for name, keys in seen.items()}
        for table, rows_ids, rows_mask in batches:
            rows = rows_ids.shape[0]
            # as the trainer replays it: its own shape, or a captured larger one of its table (TrainingGraphs._fit)
            captured = [key[1] for key in seen["current"] if key[0] == table]
            batch = graphs.static_inputs(rows_ids, rows_mask, width, graphs._fit(table, rows, False, lambda: captured))
            own = graphs.static_inputs(rows_ids, rows_mask, width)
            tokens = int(rows_mask.sum())
            replayed, natural = Shape(rows, *batch.key, batch.window, False), Shape(rows, *own.key, own.window, False)
            seen["current"].add((table, replayed))
            seen["no_reuse"].add((table, natural))
            seen["before"].add((table, rows, "packed", bucket(tokens + 1), bucket(width)))
            if table == "train":
                head["current"].append(batch.window)
                head["no_reuse"].append(own.window)
                head["before"].append(rows * bucket(width))
                head["scored_tokens"].append(int(batch.inputs["labels"].ne(-100).sum()))
                layers["current"].append(batch.key[1])
                layers["no_reuse"].append(own.key[1])
                layers["before"].append(bucket(tokens + 1))
                layers["real_tokens"].append(tokens)
                work["current"].append(reuse.work(replayed))
                work["no_reuse"].append(reuse.work(natural))
        for name in seen:
            new_per_step[name].append(len(seen[name]) - before[name])
    micro_batches = steps * per_step_rows // micro_rows
    row = {"bench": "graph_shapes", "gpu": "none (a simulation of shapes, no model run)", "shape": shape,
           "prompt_range": list(prompts), "max_completion_length": cap, "eos_prob": eos_prob, "seed": seed,
           "head_share": head_share, "reuse_capture_cost": capture_cost, "group_prompts": group_prompts,
           "share_prompts": padding_free.SHARE_PROMPTS,
           "steps": steps, "training_micro_batches": micro_batches, "reused": reuse.reused,
           "work_mean": {name: round(statistics.mean(v), 1) for name, v in work.items()},
           "scoring_chunks": steps * -(-per_step_rows // scoring_rows),
           "layer_tokens_mean": {name: round(statistics.mean(v), 1) for name, v in layers.items()},
           "head_positions_mean": {name: round(statistics.mean(v), 1) for name, v in head.items()}}
    for name, news in new_per_step.items():
        row[name] = {"shapes": len(seen[name]), "captures_by_step": news[:20],
                     "shapes_after": {n: sum(news[:n]) for n in (6, 20, 100, 500) if n <= steps}}
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--eos_prob", type=float, default=0.01)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--reuse_capture_cost", type=float, default=CAPTURE_COST,
                        help="a capture's cost in replays of the micro-batch's own shape: a new shape replays larger "
                        "captured ones while their extra work stays within it (0: every new shape captured at once)")
    parser.add_argument("--group_prompts", choices=["on", "off"], default="on",
                        help="a prompt's rows in the same training micro-batches, as the trainer orders them where "
                        "the step stays the same (off: TRL's shuffled rows)")
    parser.add_argument("--out", type=pathlib.Path)
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps must be at least 1, got {args.steps}")
    if args.reuse_capture_cost < 0:
        parser.error(f"--reuse_capture_cost must be at least 0, got {args.reuse_capture_cost}")
    for shape in args.shapes:
        row = with_provenance(simulate(shape, args.steps, args.eos_prob, args.seed,
                                       capture_cost=args.reuse_capture_cost,
                                       group_prompts=args.group_prompts == "on"))
        print(json.dumps(row))
        if args.out is not None:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            with args.out.open("a") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
