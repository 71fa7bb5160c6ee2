"""Every shipped YAML loads and is used; every path the README names exists."""

import pathlib
import re

import pytest
import yaml

ROOT = pathlib.Path(__file__).resolve().parents[1]
SKIP = {".venv", ".git", "outputs", "node_modules"}
ALL_YAML = sorted(p for p in ROOT.rglob("*.y*ml") if not SKIP & set(p.relative_to(ROOT).parts))
RECIPE_YAML = sorted((ROOT / "recipes").glob("*.yaml"))
ACCELERATE_YAML = sorted((ROOT / "accelerate_configs").glob("*.yaml"))


def test_the_globs_found_the_shipped_files():
    assert {p.stem for p in ACCELERATE_YAML} == {"single_gpu", "multi_gpu", "zero1", "zero2", "zero3", "zero3_offload",
                                               "multi_node", "multi_node_zero2"}
    assert {p.stem for p in RECIPE_YAML} >= {"quickstart", "countdown", "gsm8k"}
    assert set(ACCELERATE_YAML + RECIPE_YAML) <= set(ALL_YAML)


@pytest.mark.parametrize("path", ALL_YAML, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_yaml_parses_and_starts_with_its_launch_command(path):
    assert isinstance(yaml.safe_load(path.read_text()), dict)
    if path in RECIPE_YAML or path in ACCELERATE_YAML:
        first = path.read_text().splitlines()[0]
        assert first.startswith("# accelerate launch "), first
        assert str(path.relative_to(ROOT)) in first


@pytest.mark.parametrize("path", RECIPE_YAML, ids=lambda p: p.name)
def test_recipe_yaml_has_no_key_the_recipe_would_ignore(path):
    from trl import ModelConfig, TrlParser

    from hf_grpo import DiffuGRPOConfig, GRPOConfig
    from hf_grpo.recipe_args import RecipeArguments

    config_cls = DiffuGRPOConfig if path.stem.startswith("diffu_") else GRPOConfig  # the class its recipe parses
    parser = TrlParser((config_cls, RecipeArguments, ModelConfig))
    values = yaml.safe_load(path.read_text())
    assert parser.set_defaults_with_config(**values) == []
    # and its batch sizes satisfy the contract
    from hf_grpo.cli import build_plan

    build_plan(["--config", str(path)])


@pytest.mark.parametrize("path", ACCELERATE_YAML, ids=lambda p: p.name)
def test_accelerate_configs(path):
    config = yaml.safe_load(path.read_text())
    stage = {"zero1": 1, "zero2": 2, "zero3": 3, "zero3_offload": 3, "multi_node_zero2": 2}.get(path.stem)
    if stage:
        assert config["distributed_type"] == "DEEPSPEED"
        assert config["deepspeed_config"]["zero_stage"] == stage
        # batch sizes come from GRPOConfig through the Trainer ("auto"), never from this file
        assert "gradient_accumulation_steps" not in config["deepspeed_config"]
        offload = "cpu" if path.stem == "zero3_offload" else "none"
        assert config["deepspeed_config"]["offload_optimizer_device"] == offload
        assert config["deepspeed_config"]["offload_param_device"] == offload
    else:
        assert config["distributed_type"] == {"multi_gpu": "MULTI_GPU", "multi_node": "MULTI_GPU", "single_gpu": "NO"}[
            path.stem]
    # one machine, or a multi-node config whose every node runs the same command with its own --machine_rank
    assert config["num_machines"] == (2 if path.stem.startswith("multi_node") else 1)
    assert config["use_cpu"] is False  # CPU runs pass the override on the command line


def test_every_path_the_readme_names_exists():
    readme = (ROOT / "README.md").read_text()
    paths = set(re.findall(r"(?:recipes|accelerate_configs|bench|tests|hf_grpo|docs)/[\w./-]+\.(?:py|yaml|jsonl|json|md|png)\b", readme))
    assert paths, "the README names no file"
    missing = sorted(p for p in paths if not (ROOT / p).exists())
    assert not missing, missing


def test_no_shipped_file_cites_a_file_the_project_does_not_ship():
    """DESIGN.md and the anchors live outside the repository: a user of the package has neither."""
    shipped = [p for p in ROOT.rglob("*") if p.is_file() and p.suffix in {".py", ".md", ".yaml", ".sh", ".toml"}
               and not SKIP & set(p.relative_to(ROOT).parts)]
    pattern = re.compile(r"DESIGN\.md|shared/anchors|shared/seeds|\.\./shared")
    citing = sorted(str(p.relative_to(ROOT)) for p in shipped
                    if p.name != "test_shipped_files.py" and pattern.search(p.read_text(errors="ignore")))
    assert not citing, citing
