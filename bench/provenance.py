"""What every benchmark row records about where it came from: the commit, the GPU and the library versions.

Each script in bench/ passes the rows it prints through ``with_provenance``, so a result file says which code,
on which card and with which torch / TRL produced it. The commit is ``git rev-parse --short HEAD`` of this
checkout, unless ``$BENCH_COMMIT`` names it (a tree copied to a GPU machine can carry a stale ``.git``); with
neither it is ``"unknown"``, never a guess.
"""

from __future__ import annotations

import functools
import os
import pathlib
import subprocess

REPOSITORY = pathlib.Path(__file__).resolve().parents[1]


@functools.lru_cache(maxsize=None)
def current_commit() -> str:
    if os.environ.get("BENCH_COMMIT"):  # named by whoever ran it: a copied tree can carry a stale .git
        return os.environ["BENCH_COMMIT"]
    try:
        result = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPOSITORY, capture_output=True,
                                text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        result = None
    if result is not None and result.returncode == 0 and result.stdout.strip():
        return result.stdout.strip()
    return "unknown"


def _version(module_name: str) -> str:
    try:
        module = __import__(module_name)
    except ImportError:
        return "not installed"
    return module.__version__


@functools.lru_cache(maxsize=None)
def provenance() -> dict[str, str]:
    """commit, gpu (the CUDA device's name, or "cpu"), torch, transformers and trl versions, and ``bytecode``."""
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    return {"commit": current_commit(), "gpu": gpu, "torch": torch.__version__,
            "transformers": _version("transformers"), "trl": _version("trl"), "bytecode": bytecode()}


def bytecode() -> str:
    """How this process's imports find compiled bytecode: a cold start that compiles torch's sources at every
    import (PYTHONDONTWRITEBYTECODE and no cached bytecode) pays seconds a pip-installed machine does not."""
    import sys

    if sys.pycache_prefix:
        return f"cached under {sys.pycache_prefix}"
    return "not written (PYTHONDONTWRITEBYTECODE)" if sys.flags.dont_write_bytecode else "written beside the sources"


def with_provenance(record: dict) -> dict:
    """``record`` with the provenance fields it does not set itself (a script's own ``gpu`` wins)."""
    return {**record, **{key: value for key, value in provenance().items() if key not in record}}


def emit(record: dict, out: str | None) -> None:
    """Print ``record`` as one JSON line, and append it to ``out`` where given."""
    import json

    line = json.dumps(record)
    print(line, flush=True)
    if out:
        with open(out, "a") as fh:
            fh.write(line + "\n")
