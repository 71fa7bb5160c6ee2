"""Every shipped YAML loads and is used; every path the README names exists."""

import json
import pathlib
import re

import pytest
import yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]
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
    from hf_grpo.recipe_support.recipe_args import RecipeArguments

    config_cls = DiffuGRPOConfig if path.stem.startswith("diffu_") else GRPOConfig  # the class its recipe parses
    parser = TrlParser((config_cls, RecipeArguments, ModelConfig))
    values = yaml.safe_load(path.read_text())
    assert parser.set_defaults_with_config(**values) == []
    # and its batch sizes satisfy the contract
    from hf_grpo.cli.main import build_plan

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


# What a user reads: the front door, every docs/ page, and the benchmarks' index.
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "bench" / "README.md"]
PROJECT_PATH = re.compile(r"(?:recipes|accelerate_configs|bench|tests|hf_grpo|docs)/[\w./-]+\.(?:py|yaml|jsonl|json|md|png|txt|sh)\b")
RESULTS = ROOT / "bench" / "results"
# bench/README.md's commands write here (not tracked): those paths are outputs, not files the project ships
RUN_OUTPUT = "bench/results/raw/"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_path_a_page_names_exists(page):
    paths = set(PROJECT_PATH.findall(page.read_text()))
    assert paths or page.parent.name == "docs", f"{page.name} names no file"
    missing = sorted(p for p in paths if not p.startswith(RUN_OUTPUT) and not (ROOT / p).exists())
    assert not missing, missing


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_of_a_page_resolves(page):
    """Markdown links ``[text](target)`` to files of the repository, relative to the page, as a browser follows them."""
    targets = [t.split("#")[0] for t in re.findall(r"\]\(([^)\s]+)\)", page.read_text())]
    local = [t for t in targets if t and not re.match(r"[a-z]+:", t)]
    missing = sorted(t for t in local if not (page.parent / t).exists())
    assert not missing, missing


def test_the_readme_is_a_front_door_to_the_docs():
    """At most 300 lines; at least four docs/ pages, each one linked from the README's documentation table."""
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 300, len(readme.splitlines())
    pages = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md"))
    assert len(pages) >= 4, pages
    unlinked = [p for p in pages if f"]({p})" not in readme]
    assert not unlinked, unlinked
    assert "](bench/README.md)" in readme


def test_every_results_file_is_named_by_a_page():
    """A result file no page cites is a lab-notebook leftover; one a page cites but git lacks fails the path test."""
    text = "\n".join(page.read_text() for page in PAGES)
    unnamed = sorted(p.name for p in RESULTS.iterdir() if p.is_file() and p.name not in text)
    assert not unnamed, unnamed


def _result_rows(path: pathlib.Path) -> list[dict]:
    if path.suffix == ".jsonl":
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    data = json.loads(path.read_text())
    return data if isinstance(data, list) else [data]


@pytest.mark.parametrize("path", sorted(p for p in RESULTS.glob("*") if p.suffix in {".json", ".jsonl", ".txt"}),
                         ids=lambda p: p.name)
def test_every_result_row_records_its_commit_gpu_torch_and_trl(path):
    """``commit`` (what bench/provenance.py writes) or, for rows written before it, ``commit_added``
    (bench/README.md says what that is), plus the GPU and the torch and TRL versions."""
    if path.suffix == ".txt":
        header = path.read_text().splitlines()[0]
        assert re.match(r"# commit(_added)?: [0-9a-f]{7,}; gpu: .+; torch: .+; trl: .+", header), header
        return
    rows = _result_rows(path)
    assert rows
    for row in rows:
        commit = row.get("commit") or row.get("commit_added")
        assert commit and (commit == "unknown" or re.fullmatch(r"[0-9a-f]{7,40}", commit)), row
        assert all(row.get(key) for key in ("gpu", "torch", "trl")), sorted(row)


def test_no_shipped_file_cites_a_file_the_project_does_not_ship():
    """DESIGN.md and the anchors live outside the repository: a user of the package has neither."""
    shipped = [p for p in ROOT.rglob("*") if p.is_file() and p.suffix in {".py", ".md", ".yaml", ".sh", ".toml"}
               and not SKIP & set(p.relative_to(ROOT).parts)]
    pattern = re.compile(r"DESIGN\.md|shared/anchors|shared/seeds|\.\./shared")
    citing = sorted(str(p.relative_to(ROOT)) for p in shipped
                    if p.name != "test_shipped_files.py" and pattern.search(p.read_text(errors="ignore")))
    assert not citing, citing


def test_no_function_of_the_package_passes_80_lines():
    """A function a reader can hold at once: at most 80 lines from its ``def`` to its last line (its docstring
    counted; a nested function counts within its parent too)."""
    import ast

    long = {f"{p.relative_to(ROOT)}:{node.lineno} {node.name}": length
            for p in sorted((ROOT / "hf_grpo").rglob("*.py")) for node in ast.walk(ast.parse(p.read_text()))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and (length := node.end_lineno - node.lineno + 1) > 80}
    assert not long, f"functions over 80 lines: {long}"


def test_the_package_keeps_its_shape():
    """The house rules a newcomer relies on to find things (docs/testing.md): the top of ``hf_grpo`` holds the
    core, at most 10 modules, and every other module sits in a folder with one job; no module passes 450 lines."""
    package = ROOT / "hf_grpo"
    top = sorted(p.name for p in package.glob("*.py") if p.name != "__init__.py")
    assert len(top) <= 10, f"{len(top)} top-level modules (at most 10): {top}"
    long = {str(p.relative_to(ROOT)): n for p in package.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 450}
    assert not long, f"modules over 450 lines: {long}"
    for folder in (p for p in package.iterdir() if p.is_dir() and p.name != "__pycache__"):
        init = folder / "__init__.py"
        assert init.exists() and init.read_text().lstrip().startswith('"""'), f"{folder.name}/ says not its job"
