"""A recipe's ``--config`` YAML, read with errors that name the file, and integer fields given a number that is
not an integer refused naming the field.

TRL's parser reads the file too, but a file that is not text fails there with a bare ``UnicodeDecodeError``, and
the YAML's values become argparse defaults, which argparse converts only when they are text: ``seed: 1.5`` or
``max_steps: 2.5`` reached the config as floats and failed later in numpy or transformers without naming the field.
On the command line argparse already refuses them (``argument --seed: invalid int value: '1.5'``); the YAML gets the
same rule: an integer field takes an integer, and ``2.0`` is refused as ``--max_steps 2.0`` is.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Iterable, Mapping
from typing import Any

import yaml


def read_config_file(path: str) -> dict[str, Any]:
    """The mapping the YAML file at ``path`` holds ({} for an empty file), or a ValueError naming the file."""
    try:
        with open(path, "rb") as handle:
            raw = handle.read()
    except OSError as err:
        raise ValueError(f"--config {path}: cannot be read ({err.strerror or err})") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(
            f"--config {path} is not a text file (byte {err.start} is {raw[err.start:err.start + 1]!r}, not UTF-8): "
            f"--config takes a YAML file of field: value lines, such as recipes/quickstart.yaml"
        ) from None
    try:
        values = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ValueError(f"--config {path} is not valid YAML{where}: {problem}") from None
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise ValueError(f"--config {path} holds a YAML {type(values).__name__}, not a mapping of field: value lines")
    return values


def _integer_only(hint) -> bool:
    """Whether a field's type admits integers only (``int``, ``int | None``), not text or floats too."""
    if hint is int:
        return True
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return {arg for arg in typing.get_args(hint) if arg is not type(None)} == {int}
    return False


def integer_fields(classes: Iterable[type]) -> dict[str, str]:
    """Field name -> ``Class.field`` for the dataclass fields typed as integers only."""
    found = {}
    for cls in classes:
        hints = typing.get_type_hints(cls)
        for item in dataclasses.fields(cls):
            if item.name not in found and _integer_only(hints.get(item.name)):
                found[item.name] = f"{cls.__name__}.{item.name}"
    return found


def check_integer_values(values: Mapping[str, Any], classes: Iterable[type], source: str) -> None:
    """Refuse a float (or a bool) given to an integer field, naming ``source``, the field, the value and what is
    valid. Text is left to argparse, which converts it or refuses it naming the flag."""
    wrong = {name: value for name, value in values.items() if isinstance(value, (float, bool))}
    if not wrong:
        return
    fields = integer_fields(classes)
    for name, value in wrong.items():
        if name not in fields:
            continue
        if isinstance(value, bool):
            hint = "an integer, not true/false"
        elif math.isfinite(value) and value == int(value):
            hint = f"an integer: write {int(value)}, without the decimal point (as --{name} {int(value)})"
        elif math.isfinite(value):
            hint = f"an integer, e.g. {math.floor(value)} or {math.ceil(value)}"
        else:
            hint = "an integer"
        raise ValueError(f"{source}: {name}: {value!r} is not valid: {fields[name]} takes {hint}")
