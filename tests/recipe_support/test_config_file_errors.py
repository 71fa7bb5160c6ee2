"""A recipe's ``--config`` YAML that is not text, or that gives an integer field a float, is an error naming the file,
the field and the value (hf_grpo.recipe_support.config_file); the command line refuses the same values (argparse),
and ``hf-grpo plan --config`` names a binary file too."""

import pytest
from tests.project_files import load_recipe

from hf_grpo.recipe_support.launch import parse_recipe_args

QUICKSTART = load_recipe("quickstart")


def parse(tmp_path, *argv, defaults=None):
    return parse_recipe_args(QUICKSTART.DEFAULTS if defaults is None else defaults,
                             [*argv, "--output_dir", str(tmp_path / "out")])


def config_file(tmp_path, text: str):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("line, expected", [
    ("seed: 1.5", r"seed: 1.5 is not valid: GRPOConfig.seed takes an integer, e.g. 1 or 2"),
    ("max_steps: 2.5", r"max_steps: 2.5 is not valid: GRPOConfig.max_steps takes an integer, e.g. 2 or 3"),
    # refused as `--max_steps 2.0` is on the command line
    ("max_steps: 2.0", r"max_steps: 2.0 is not valid: .* write 2, without the decimal point"),
    ("num_train_samples: 7.5", r"num_train_samples: 7.5 is not valid: RecipeArguments.num_train_samples takes"),
    ("seed: true", r"seed: True is not valid: GRPOConfig.seed takes an integer, not true/false"),
])
def test_a_float_in_an_integer_field_of_the_yaml_is_refused_naming_file_field_and_value(tmp_path, line, expected):
    path = config_file(tmp_path, f"{line}\n")
    with pytest.raises(ValueError, match=rf"^--config {path}: {expected}"):
        parse(tmp_path, "--config", path)


def test_the_recipe_defaults_are_checked_the_same_way(tmp_path):
    with pytest.raises(ValueError, match=r"^the recipe's defaults: seed: 0.5 is not valid"):
        parse(tmp_path, defaults={**QUICKSTART.DEFAULTS, "seed": 0.5})


def test_integers_floats_and_text_the_fields_take_are_read_as_before(tmp_path):
    path = config_file(tmp_path, "seed: 7\nmax_steps: '3'\nlearning_rate: 1\nbeta: 0.5\n")
    training_args, _, _ = parse(tmp_path, "--config", path)
    assert (training_args.seed, training_args.max_steps, training_args.learning_rate) == (7, 3, 1)
    assert training_args.beta == 0.5


@pytest.mark.parametrize("flag", ["--seed", "--max_steps"])
@pytest.mark.parametrize("value", ["1.5", "2.0"])
def test_the_same_floats_as_flags_are_refused_naming_the_flag_and_the_value(tmp_path, capsys, flag, value):
    with pytest.raises(SystemExit):
        parse(tmp_path, flag, value)
    err = capsys.readouterr().err
    assert f"argument {flag}" in err and f"invalid int value: '{value}'" in err


def test_a_binary_config_file_is_named(tmp_path):
    path = tmp_path / "model.bin"
    path.write_bytes(b"\x89PNG\r\n\x1a\n\x00\xb1\xff" * 10)
    with pytest.raises(ValueError, match=rf"^--config {path} is not a text file \(byte 0 is b'\\x89', not UTF-8\)"):
        parse(tmp_path, "--config", str(path))


def test_a_config_file_that_is_not_a_mapping_is_named(tmp_path):
    path = config_file(tmp_path, "- seed\n- 1\n")
    with pytest.raises(ValueError, match=rf"^--config {path} holds a YAML list, not a mapping"):
        parse(tmp_path, "--config", path)


def test_plan_names_a_binary_config_file(tmp_path, capsys):
    from hf_grpo.cli.main import main

    path = tmp_path / "model.bin"
    path.write_bytes(b"\xb1\xff\x00" * 10)
    assert main(["plan", "--config", str(path)]) == 1
    assert f"error: {path} is not a text file (byte 0 is not UTF-8)" in capsys.readouterr().err
