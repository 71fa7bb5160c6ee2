"""What a GPU would give each Triton kernel of the decode attention, found on a machine without one.

The kernels are compiled exactly as a launch on the GPU would compile them: ``filled_attention`` runs its own
launch path over tensors of the 7B full-length rollout's decode step (32 rows of Qwen2.5-7B's heads, a 3072-position
cache), Triton's JIT specialises the arguments as it does on the GPU (unit strides as constants, 16-byte aligned
pointers and strides), and a driver that only names the target (sm_90 by default) stands in for the device. For
each compiled kernel, one JSON line: its registers a thread, the bytes it spills to the stack, its shared memory a
program, and how many of its programs an SM can hold by each limit (``SM_LIMITS``; an H100's: 65,536 registers,
227 KiB of shared memory a program may take, 64 warps). Occupancy decides how many loads a memory-bound kernel keeps in flight; a profile on the
GPU is still what says whether it pays.

Needs Triton (``pip install triton``), whose wheel carries ``ptxas``; no GPU, no CUDA driver.

    python bench/kernel_resources.py [--arch 90] [--sms 132] [--shared-prompts] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/: provenance.py
from provenance import emit, with_provenance  # noqa: E402
import torch  # noqa: E402

from hf_grpo.generation import filled_attention  # noqa: E402

ROWS, KV_HEADS, GROUPS, DIM, CACHE, FILLED, PROMPT = 32, 4, 7, 128, 3072, 544 + 1024, 1024
# An SM's registers, the shared memory its programs may take, and its warps, by compute capability (CUDA's
# programming guide): A100; A10/RTX 30; L4/L40/RTX 40; H100/H200; B200.
SM_LIMITS = {80: (65536, 163 * 1024, 64), 86: (65536, 99 * 1024, 48), 89: (65536, 99 * 1024, 48),
             90: (65536, 227 * 1024, 64), 100: (65536, 227 * 1024, 64)}


def _compile_only_driver(arch: int):
    """A Triton driver that compiles for ``arch`` and launches nothing."""
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.driver import CudaDriver

    class CompileOnly(CudaDriver):
        def __init__(self):  # CudaDriver's would load libcuda
            pass

        def get_current_target(self):
            return GPUTarget("cuda", arch, 32)

        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

    return CompileOnly()


def _usage(kernel) -> dict:
    """Registers and stack bytes of the compiled kernel, read from its cubin by the wheel's cuobjdump."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as folder:
        cubin = os.path.join(folder, "kernel.cubin")
        Path(cubin).write_bytes(kernel.asm["cubin"])
        text = subprocess.run([str(tool), "--dump-resource-usage", cubin], capture_output=True, text=True,
                              check=True).stdout
    line = next(part for part in text.splitlines() if "REG:" in part)
    fields = dict(item.split(":") for item in line.split() if ":" in item and item.split(":")[1].isdigit())
    return {"registers": int(fields["REG"]), "stack_bytes": int(fields["STACK"])}


def compiled_launches(arch: int, sms: int, shared_prompts: bool) -> list[dict]:
    """Each kernel ``filled_attention`` launches at the rollout's mean decode step, compiled for ``arch``."""
    import triton

    records = []

    class Recorder:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                compiled = self.kernel.warmup(*args, grid=grid, **kwargs)
                warps, stages = kwargs.get("num_warps", 4), kwargs.get("num_stages", 3)
                usage = _usage(compiled)
                shared = compiled.metadata.shared
                registers, shared_bytes, sm_warps = SM_LIMITS[arch]
                by_registers = registers // (usage["registers"] * 32 * warps)
                by_shared = shared_bytes // shared if shared else sm_warps // warps
                records.append({"kernel": self.kernel.fn.__name__, "grid": list(grid), "num_warps": warps,
                                "num_stages": stages, **usage, "shared_memory_bytes": shared,
                                "programs_per_sm_by_registers": by_registers,
                                "programs_per_sm_by_shared_memory": by_shared,
                                "programs_per_sm": min(by_registers, by_shared, sm_warps // warps)})
            return launch

    # ``_active``, not ``active``: reading the property would build the default driver, which loads libcuda
    kernels, sms_of, driver = filled_attention._kernels, filled_attention._sms, triton.runtime.driver._active
    triton.runtime.driver.set_active(_compile_only_driver(arch))
    filled_attention._kernels = lambda: tuple(Recorder(kernel) for kernel in kernels())
    filled_attention._sms = lambda index: sms
    try:
        _launch_at_the_rollout(shared_prompts)
    finally:  # the op, Triton's driver and the kernels' caches as they were, for anything else in the process
        filled_attention._kernels, filled_attention._sms = kernels, sms_of
        triton.runtime.driver.set_active(driver)
        for kernel in kernels():
            kernel.device_caches.clear()
    return records


def _launch_at_the_rollout(shared_prompts: bool) -> None:
    query = torch.zeros(ROWS, KV_HEADS, GROUPS, DIM, dtype=torch.bfloat16)
    key = torch.zeros(ROWS, KV_HEADS, CACHE, DIM, dtype=torch.bfloat16)
    valid = torch.zeros(ROWS, CACHE, dtype=torch.bool)
    valid[:, :FILLED] = True
    extra = ()
    if shared_prompts:  # GRPO's rows of one prompt, 8 each
        extra = ((torch.arange(ROWS) // 8 * 8).int(), torch.tensor([PROMPT], dtype=torch.int32))
    filled_attention._triton_decode_attention(query, key, key.clone(), valid, DIM**-0.5, *extra)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability to compile for (90: H100, H200)")
    parser.add_argument("--sms", type=int, default=132, help="the GPU's SMs, which set the attention's splits")
    parser.add_argument("--shared-prompts", action="store_true",
                        help="rows of one prompt read it from its first row (GRPO's groups of 8)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.arch not in SM_LIMITS:
        parser.error(f"--arch must be one of {sorted(SM_LIMITS)} (bf16 tensor cores, known SM limits), got {args.arch}")
    import triton

    for record in compiled_launches(args.arch, args.sms, args.shared_prompts):
        emit(with_provenance({"bench": "kernel_resources", "gpu": f"none: compiled for sm_{args.arch} on the host",
                              "triton": triton.__version__, "shape": "7b-x32", "cache_len": CACHE, "filled": FILLED,
                              "shared_prompts": args.shared_prompts, **record}), args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
