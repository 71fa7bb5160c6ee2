"""A recipe's settings are written once, in its YAML: the recipe reads them from there, with or without --config."""

import shutil

import pytest
import yaml
from tests.project_files import ROOT, load_file, load_recipe

from hf_grpo import DiffuGRPOConfig, GRPOConfig
from hf_grpo.recipe_support.launch import parse_recipe_args, recipe_defaults

RECIPES = ["quickstart", "countdown", "gsm8k", "diffu_countdown"]  # the recipes with a YAML
DERIVED = {"steps_per_generation", "generation_batch_size"}  # follow gradient_accumulation_steps when left unset


def parse(name, module, argv):
    config_cls = DiffuGRPOConfig if name.startswith("diffu_") else GRPOConfig
    training_args, recipe_args, model_args = parse_recipe_args(module.DEFAULTS, argv, config_cls)
    return {**training_args.to_dict(), **vars(recipe_args), **vars(model_args)}


@pytest.mark.parametrize("name", RECIPES)
def test_a_value_changed_in_the_yaml_reaches_the_run_without_config(tmp_path, name):
    """Edit the YAML beside a copy of the recipe: the copy's run without --config takes the new value."""
    shutil.copy(ROOT / "recipes" / f"{name}.py", tmp_path)
    values = yaml.safe_load((ROOT / "recipes" / f"{name}.yaml").read_text())
    assert values["learning_rate"] != 2.5e-5
    values["learning_rate"] = 2.5e-5
    (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(values))
    module = load_file(tmp_path / f"{name}.py", f"edited_{name}")
    assert module.DEFAULTS["learning_rate"] == 2.5e-5
    assert parse(name, module, ["--output_dir", str(tmp_path / "out")])["learning_rate"] == 2.5e-5


@pytest.mark.parametrize("name", RECIPES)
def test_without_config_a_recipe_runs_its_yaml_but_for_its_launch_only_keys(tmp_path, name):
    """``python recipes/X.py`` and ``python recipes/X.py --config recipes/X.yaml`` differ only in the keys the
    recipe names LAUNCH_ONLY (bf16 weights, accumulation, chunk sizes, seed, ...), each of which the YAML sets."""
    module = load_recipe(name)
    launch_only = set(getattr(module, "LAUNCH_ONLY", ()))
    out = ["--output_dir", str(tmp_path / "out")]
    bare = parse(name, module, out)
    configured = parse(name, module, ["--config", str(ROOT / "recipes" / f"{name}.yaml"), *out])
    differ = {key for key in configured if bare.get(key) != configured[key]} - DERIVED
    assert differ <= launch_only, differ - launch_only
    assert launch_only <= set(yaml.safe_load((ROOT / "recipes" / f"{name}.yaml").read_text()))


def test_a_launch_only_key_the_yaml_does_not_set_is_refused(tmp_path):
    (tmp_path / "r.yaml").write_text("learning_rate: 1.0e-5\nseed: 3\n")
    assert recipe_defaults(str(tmp_path / "r.py"), ("seed",)) == {"learning_rate": 1.0e-5}
    with pytest.raises(ValueError, match=r"launch_only names \['dtype'\], which .*r.yaml does not set; its keys: "
                                         r"\['learning_rate', 'seed'\]"):
        recipe_defaults(str(tmp_path / "r.py"), ("dtype", "seed"))
