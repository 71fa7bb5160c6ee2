"""Where ``training_cuda_graphs`` spends memory and time: a realistic run (``bench/grpo_realistic.py``, same flags)
with each bucket's eager warm-up and each capture (forward, then backward) wrapped, printing one JSON row each:
memory allocated before, the peak inside, allocated after, reserved after (GiB), and seconds.

    python3 bench/training_graph_memory_probe.py --impl hf_grpo --shape 0.5b --max_steps 8 --phases \\
        --training_cuda_graphs on --compile_training off --out $OUT/runs.jsonl

Each capture after the run's first also gets a row of the host's seconds inside the recorded function against the
whole record (the rest is the device wait, the allocator and instantiating the graph); with ``PROBE_PROFILE=1``
the row lists the functions that took the most of it (cProfile, which slows the host).

Rows, each with its commit, GPU, torch and TRL, go to stdout (``PROBE {...}``) and to
``$OUT/graph_memory_probe.jsonl``. The run's own peak figures stay those of the whole run (the wrapper restores
torch's peak counter after each part it measures).
"""

import cProfile
import json
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
import grpo_realistic  # noqa: E402
from provenance import with_provenance  # noqa: E402

from hf_grpo.training import graphs as training_graphs  # noqa: E402

ROWS = []
GIB = 2**30


def measured(name, fn):
    def inner(*args, **kwargs):
        torch.cuda.synchronize()
        before, run_peak = torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        ROWS.append(dict(what=name, before=round(before / GIB, 3), peak=round(peak / GIB, 3),
                         after=round(torch.cuda.memory_allocated() / GIB, 3),
                         reserved=round(torch.cuda.memory_reserved() / GIB, 3),
                         s=round(time.perf_counter() - start, 3)))
        if run_peak > peak:  # put the run's peak back: allocate up to it once, then free
            torch.cuda.reset_peak_memory_stats()
            filler = torch.empty(int(run_peak - torch.cuda.memory_allocated()), dtype=torch.uint8, device="cuda")
            del filler
        return out
    return inner


def top_functions(profile: cProfile.Profile, n: int = 25) -> list:
    stats = pstats.Stats(profile).stats  # (file, line, name) -> (calls, primitive calls, tottime, cumtime, callers)
    rows = sorted(stats.items(), key=lambda item: -item[1][2])[:n]
    return [[f"{os.path.basename(file)}:{line}:{name}", calls, round(tottime, 4), round(cumtime, 4)]
            for (file, line, name), (calls, _, tottime, cumtime, _) in rows]


def timed_record(record, with_profile: bool):
    """``CudaGraphRecorder.record`` with the host's time inside the recorded function (and its top functions)."""
    seen = [0]

    def inner(self, fn, pool):
        seen[0] += 1
        if seen[0] <= 2:  # the run's first capture (forward, backward): warm-up effects, not a capture's cost
            return record(self, fn, pool)
        inside, profile = [0.0], cProfile.Profile()

        def timed_fn():
            start = time.perf_counter()
            if with_profile:
                profile.enable()
            try:
                return fn()
            finally:
                profile.disable()
                inside[0] = time.perf_counter() - start

        torch.cuda.synchronize()
        start = time.perf_counter()
        out = record(self, timed_fn, pool)
        row = dict(what="record_host", s=round(time.perf_counter() - start, 4), fn_s=round(inside[0], 4))
        ROWS.append(row | (dict(top=top_functions(profile)) if with_profile else {}))
        return out
    return inner


def main() -> int:
    graphs = training_graphs.TrainingGraphs
    graphs._warm_up = measured("warm_up", graphs._warm_up)
    record = timed_record(training_graphs.CudaGraphRecorder.record, os.environ.get("PROBE_PROFILE") == "1")
    training_graphs.CudaGraphRecorder.record = measured("record", record)
    capture = graphs._capture

    def named_capture(self, score, inputs, window, shape):
        # rows, then the layout's key: ("padded", prompt bucket) or ("packed", packed length); the completion window
        ROWS.append(dict(what="bucket", shape=[str(part) for part in shape[:-1]]))
        return capture(self, score, inputs, window, shape)

    graphs._capture = named_capture
    try:
        return grpo_realistic.main()
    finally:
        rows = [with_provenance(row) for row in ROWS]  # commit, GPU, torch and TRL on every row
        with open(os.path.join(os.environ.get("OUT", "/tmp"), "graph_memory_probe.jsonl"), "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
        for row in rows:
            print("PROBE", json.dumps(row))


if __name__ == "__main__":
    sys.exit(main())
