"""Scripts of the repository that are not package code (recipes/, bench/, test fixtures), loaded by their path."""

from __future__ import annotations

import importlib.util
import pathlib
from types import ModuleType

ROOT = pathlib.Path(__file__).resolve().parents[1]


def load_file(path: str | pathlib.Path, name: str) -> ModuleType:
    """The module in ``path``, executed under ``name`` (not registered in ``sys.modules``)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_recipe(name: str) -> ModuleType:
    return load_file(ROOT / "recipes" / f"{name}.py", f"recipe_{name}")


def load_bench(name: str) -> ModuleType:
    return load_file(ROOT / "bench" / f"{name}.py", f"bench_{name}")
