"""The machinery of translating another framework's batch settings: knobs, typed values, exact divisions that
fail naming the key, the value and the nearest valid values, and the ``Translation`` checked against the source's
own arithmetic. ``translate`` holds each framework's knobs and rules.

May import: ``hf_grpo.plan`` and the standard library (no torch: like ``plan``, this is arithmetic).
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from ..plan import BatchPlan, nearest_valid


class TranslationError(ValueError):
    """A setting that cannot be translated: names the key, the value and what would be valid."""


@dataclass(frozen=True)
class Knob:
    key: str  # the full dotted path, as the framework's config spells it
    meaning: str
    kind: type = int  # int or bool
    neutral: Any = None  # for knobs hf-grpo lacks: the one value that needs no equivalent
    lacks: str = ""  # why hf-grpo has no equivalent (then any other value is an error)


@dataclass(frozen=True)
class Translation:
    framework: str
    fields: dict[str, Any]  # hf-grpo field -> value, in the order the flags are printed
    world_size: int
    plan: BatchPlan
    source: str  # the source framework's own arithmetic, in its own words
    notes: tuple[str, ...] = ()

    def flags(self) -> str:
        """The fields as command-line flags of a recipe (``--name value``)."""
        return " ".join(f"--{name} {str(value).lower() if isinstance(value, bool) else value}"
                        for name, value in self.fields.items())


def parse_settings(pairs: Iterable[str]) -> dict[str, str]:
    """``["a.b=1", ...]`` -> ``{"a.b": "1"}``; a pair without ``=`` is an error naming it."""
    settings: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise TranslationError(f"{pair!r} is not KEY=VALUE (e.g. train_batch_size=256)")
        key = key.strip().lstrip("+-")  # Hydra's +key=, and --key=value as OpenRLHF users type it
        if key in settings:
            raise TranslationError(f"{key} is given twice ({settings[key]!r} and {value!r}); give it once")
        settings[key] = value.strip()
    return settings


def flatten_config(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """A framework's nested YAML config as dotted keys: ``{"data": {"train_batch_size": 8}}`` ->
    ``{"data.train_batch_size": 8}``."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat.update(flatten_config(value, name + "."))
        else:
            flat[name] = value
    return flat


def matching_knobs(knobs: tuple[Knob, ...], given: str) -> list[Knob]:
    return [k for k in knobs if k.key == given] or [k for k in knobs if k.key.endswith("." + given)]


def close_knob(knobs: tuple[Knob, ...], given: str) -> str | None:
    """The knob ``given`` is a likely typo of: same parent path (if one is given), a last segment nearly equal.
    Strict (ratio >= 0.88, at most 3 characters longer or shorter), so that real non-batch keys of a pasted
    config (``data.val_batch_size``, ``critic.ppo_mini_batch_size``) are never taken for typos."""
    parent, _, leaf = given.rpartition(".")
    leaves = {}
    for knob in knobs:
        knob_parent, _, knob_leaf = knob.key.rpartition(".")
        if not parent or ("." + knob_parent).endswith("." + parent):
            leaves.setdefault(knob_leaf, knob.key)
    close = difflib.get_close_matches(leaf, list(leaves), n=1, cutoff=0.88)
    if close and abs(len(close[0]) - len(leaf)) <= 3:
        return leaves[close[0]]
    return None


def is_null(raw: Any) -> bool:
    return raw is None or str(raw).strip().lower() in ("null", "none", "~", "")


def unknown_key_error(framework: str, knobs: tuple[Knob, ...], given: str):
    near = close_knob(knobs, given)
    hint = f"; did you mean {near!r}?" if near else ";"
    raise TranslationError(f"{framework}: unknown key {given!r}{hint} the {framework} keys hf-grpo translates "
                           f"are: {', '.join(k.key for k in knobs)}")


def resolve_knobs(framework: str, knobs: tuple[Knob, ...], settings: Mapping[str, Any]) -> dict[str, Any]:
    """Full key -> typed value. A key may be its full path or any unambiguous dotted tail of it."""
    found: dict[str, Any] = {}
    for given, raw in settings.items():
        matches = matching_knobs(knobs, given)
        if not matches:
            unknown_key_error(framework, knobs, given)
        if len(matches) > 1:
            raise TranslationError(f"{framework}: {given!r} is ambiguous, it ends "
                                   f"{' and '.join(k.key for k in matches)}; give the full key")
        knob = matches[0]
        if knob.key in found:
            raise TranslationError(f"{framework}: {knob.key} is given twice; give it once")
        value = typed_value(framework, knob, raw)
        if value is None:
            continue  # null / None: left unset, as in the framework's own config
        if knob.lacks and value != knob.neutral:
            raise TranslationError(f"{framework}: {knob.key}={raw} has no hf-grpo equivalent: {knob.lacks} "
                                   f"(only {knob.key}={knob.neutral} translates)")
        found[knob.key] = value
    return found


def typed_value(framework: str, knob: Knob, raw: Any) -> Any:
    if knob.kind is bool:
        if isinstance(raw, bool):
            return raw
        text = str(raw).strip().lower()
        if text in ("true", "1", "yes"):
            return True
        if text in ("false", "0", "no"):
            return False
        raise TranslationError(f"{framework}: {knob.key}={raw!r} is not a boolean; give true or false")
    if isinstance(raw, bool):
        raise TranslationError(f"{framework}: {knob.key}={raw!r} is not an integer")
    if isinstance(raw, int):
        value = raw
    else:
        text = str(raw).strip()
        if text.lower() in ("null", "none", "~"):
            return None
        try:
            value = int(text.replace("_", ""))
        except ValueError:
            raise TranslationError(f"{framework}: {knob.key}={raw!r} is not an integer; give a whole number "
                                   f"({knob.meaning})") from None
    if value < 1:
        raise TranslationError(f"{framework}: {knob.key}={value} must be >= 1 ({knob.meaning})")
    return value


def required_values(framework: str, values: Mapping[str, Any], *keys: str, why: str = "") -> list[Any]:
    missing = [k for k in keys if k not in values]
    if missing:
        raise TranslationError(f"{framework}: missing {', '.join(missing)}{why}; give it (e.g. {missing[0]}=VALUE): "
                               f"hf-grpo does not assume {framework}'s defaults, which change between versions")
    return [values[k] for k in keys]


Fixes = Mapping[str, tuple[int, Callable[[int], bool]]]


def divide_exactly(framework: str, what: str, value: int, by_what: str, by: int, why: str,
                   fixes: Fixes | None = None) -> int:
    """``value // by``, or an error naming both values and, per knob in ``fixes``, its nearest valid values
    (default: ``what`` and ``by_what`` themselves)."""
    if value % by == 0:
        return value // by
    if fixes is None:
        fixes = {what: (value, lambda v: v % by == 0), by_what: (by, lambda d: value % d == 0)}
    options = []
    for name, (current, ok) in fixes.items():
        near = sorted(nearest_valid(current, ok, limit=1 << 16))  # the one below, then the one above
        if near:
            options.append(f"{name}: {' or '.join(map(str, near))}")
    raise TranslationError(f"{framework}: {what} = {value} is not a multiple of {by_what} = {by}, so {why}; "
                           f"nearest valid " + "; or ".join(options))


def mini_batch_fixes(key: str, mini: int, prompts: int, G: int, world: int) -> Fixes:
    """Mini-batches (in prompts) that split over the GPUs and divide the rollout, or GPU counts that fit."""
    return {key: (mini, lambda m: m * G % world == 0 and prompts % m == 0),
            "GPUs": (world, lambda w: mini * G % w == 0)}


def group_size(framework: str, key: str, values: Mapping[str, Any]) -> int:
    (n,) = required_values(framework, values, key)
    if n < 2:
        raise TranslationError(f"{framework}: {key}={n}: GRPO compares the completions of one prompt, so it "
                               f"needs at least 2 per prompt (num_generations >= 2); set {key} to 2 or more")
    return n


def world_size_from(framework: str, values: Mapping[str, Any], nodes_key: str | None, gpus_key: str | None,
                    world_size: int | None) -> int:
    """Data-parallel processes: --num_processes, or the framework's nodes x GPUs per node; both must agree."""
    if world_size is not None and world_size < 1:
        raise TranslationError(f"--num_processes must be >= 1, got {world_size}")
    if gpus_key is None or gpus_key not in values:
        if nodes_key is not None and nodes_key in values:
            raise TranslationError(f"{framework}: {nodes_key} is given without {gpus_key}; give both, or "
                                   f"--num_processes")
        return 1 if world_size is None else world_size
    nodes = values.get(nodes_key, 1)
    gpus = nodes * values[gpus_key]
    if world_size is not None and world_size != gpus:
        raise TranslationError(f"{framework}: --num_processes {world_size} disagrees with {nodes_key} x "
                               f"{gpus_key} = {nodes} x {values[gpus_key]} = {gpus}; drop one or make them agree")
    return gpus


def finish_translation(framework: str, fields: dict[str, Any], world: int, source: str, notes: list[str],
                       source_batch: int, source_steps: Fraction, source_rollout: int) -> Translation:
    """Build and validate the plan, and check it against the source framework's own arithmetic."""
    P, A = fields["per_device_train_batch_size"], fields["gradient_accumulation_steps"]
    S = fields.get("steps_per_generation", A)
    plan = BatchPlan(
        per_device_train_batch_size=P,
        gradient_accumulation_steps=A,
        steps_per_generation=S,
        num_generations=fields["num_generations"],
        num_iterations=fields.get("num_iterations", 1),
        per_device_generation_batch_size=fields.get("per_device_generation_batch_size", P * S),
        tensor_batch_size=fields.get("tensor_batch_size", 1024),
        world_size=world,
        max_tokens_per_micro_batch=fields.get("max_tokens_per_micro_batch"),
    )
    try:
        plan.validate()
    except ValueError as err:
        raise TranslationError(f"{framework}: the translated sizes break hf-grpo's batch contract: {err}") from None
    same = (plan.global_batch_size, plan.optimizer_steps_per_rollout, plan.global_rollout)
    if same != (source_batch, source_steps, source_rollout):  # a bug in this module, never the user's input
        raise RuntimeError(f"{framework} translation disagrees with the source arithmetic: hf-grpo {same}, "
                           f"{framework} {(source_batch, source_steps, source_rollout)}")
    return Translation(framework, fields, world, plan, source, tuple(notes))


def counted(count: int, word: str) -> str:
    return f"{count} {word}" + ("" if count == 1 else "es" if word.endswith("s") else "s")
