"""What this GPU can do, measured once and kept: its bf16 matmul rate and its memory bandwidth.

A datasheet's peak is not what a program gets (an H100 SXM is sold at 989 dense bf16 TFLOP/s and runs a large
GEMM near 800; the same card's clocks and memory differ between hosts), so the efficiency figures divide by rates
measured here: a large bf16 matrix product and a large device-to-device copy. They take about a second, once per
GPU model, torch and CUDA version: the result is kept in ``$HF_GRPO_CACHE/device_rates.json`` (default
``~/.cache/hf_grpo``). On a CPU there is nothing to measure and nothing is reported.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import tempfile

import torch

logger = logging.getLogger("hf_grpo")

CACHE_ENV = "HF_GRPO_CACHE"
CACHE_FILE = "device_rates.json"
MATMUL_SIZE = 8192  # three 128 MiB bf16 matrices: large enough to reach the tensor cores' sustained rate
COPY_BYTES = 2**29  # two 512 MiB buffers


@dataclasses.dataclass(frozen=True)
class DeviceRates:
    device_name: str
    matmul_tflops: float  # bf16, dense
    copy_gbps: float  # bytes read plus bytes written, per second: what a decode step's reads are held against


def cache_path() -> str:
    root = os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "hf_grpo")
    return os.path.join(root, CACHE_FILE)


def _key(device: torch.device) -> str:
    return f"{torch.cuda.get_device_name(device)} | torch {torch.__version__} | cuda {torch.version.cuda}"


def device_rates(device: torch.device) -> DeviceRates | None:
    """This CUDA device's measured rates (from the cache where measured before), None on other devices."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    key, path = _key(device), cache_path()
    cached = _read_cache(path)
    if isinstance(cached.get(key), dict):
        try:
            return DeviceRates(**cached[key])
        except TypeError:
            pass  # a file from another version of this module: measured again below
    try:
        rates = measure(device)
    except torch.OutOfMemoryError:  # the run's memory comes first: no efficiency figures, nothing else lost
        torch.cuda.empty_cache()
        logger.warning("no room on %s to measure its matmul rate and bandwidth: no efficiency figures", device)
        return None
    cached[key] = dataclasses.asdict(rates)
    _write_cache(path, cached)
    return rates


def measure(device: torch.device, repeats: int = 10) -> DeviceRates:
    """A bf16 ``MATMUL_SIZE``-cubed product and a ``COPY_BYTES`` copy, each timed over ``repeats`` after warm-up."""
    with torch.cuda.device(device):
        a = torch.randn(MATMUL_SIZE, MATMUL_SIZE, device=device, dtype=torch.bfloat16)
        b = torch.randn_like(a)
        seconds = _timed(lambda: torch.mm(a, b), repeats)
        matmul = 2 * MATMUL_SIZE**3 / seconds / 1e12
        del a, b
        source = torch.empty(COPY_BYTES, dtype=torch.uint8, device=device)
        target = torch.empty_like(source)
        seconds = _timed(lambda: target.copy_(source), repeats)
        copy = 2 * COPY_BYTES / seconds / 1e9
        del source, target
        torch.cuda.empty_cache()
    return DeviceRates(torch.cuda.get_device_name(device), round(matmul, 1), round(copy, 1))


def _timed(work, repeats: int) -> float:
    for _ in range(3):
        work()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        work()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / repeats


def _read_cache(path: str) -> dict:
    try:
        with open(path) as handle:
            data = json.load(handle)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as error:  # unreadable or torn: measure again and write a whole file
        logger.warning("ignoring the device-rate cache %s (%s); measuring again", path, error)
        return {}
    return data if isinstance(data, dict) else {}


def _write_cache(path: str, data: dict) -> None:
    """Whole or not at all (ranks measuring at the same time each replace the file with a complete one)."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        handle, temporary = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".device_rates.")
        with os.fdopen(handle, "w") as out:
            json.dump(data, out, indent=1)
        os.replace(temporary, path)
    except OSError as error:  # a read-only home: the rates are still used for this run
        logger.warning("could not keep the measured device rates in %s (%s)", path, error)
