"""bench/provenance.py: every row a benchmark prints says which commit, GPU, torch and TRL produced it."""

import pathlib
import shutil
import subprocess
import sys

import torch
import trl
from tests.project_files import ROOT, load_file

BENCH = ROOT / "bench"


def _fresh_provenance(directory: pathlib.Path, name: str):
    """bench/provenance.py loaded from ``directory`` (its repository is that directory's parent)."""
    return load_file(directory / "provenance.py", name)


def test_a_row_gets_the_checkouts_commit_and_versions_and_keeps_its_own_fields(monkeypatch):
    monkeypatch.delenv("BENCH_COMMIT", raising=False)
    provenance = _fresh_provenance(BENCH, "bench_provenance_here")
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    expected_commit = head.stdout.strip() if head.returncode == 0 else "unknown"
    row = provenance.with_provenance({"gpu": "the script's own name for it", "seconds": 1.5})
    assert row == {"gpu": "the script's own name for it", "seconds": 1.5, "commit": expected_commit,
                   "torch": torch.__version__, "transformers": row["transformers"], "trl": trl.__version__,
                   "bytecode": row["bytecode"]}
    assert provenance.with_provenance({})["gpu"] == (torch.cuda.get_device_name(0) if torch.cuda.is_available()
                                                     else "cpu")


def test_a_row_says_whether_imports_compiled_sources_so_cold_starts_compare(monkeypatch):
    """A machine that writes no bytecode compiles torch's sources in every process: seconds of a first step."""
    provenance = _fresh_provenance(BENCH, "bench_provenance_bytecode")
    monkeypatch.setattr(sys, "pycache_prefix", "/tmp/pyc")
    assert provenance.bytecode() == "cached under /tmp/pyc"
    monkeypatch.setattr(sys, "pycache_prefix", None)
    expected = ("not written (PYTHONDONTWRITEBYTECODE)" if sys.flags.dont_write_bytecode
                else "written beside the sources")
    assert provenance.bytecode() == expected


def test_outside_git_the_commit_is_the_environments_or_unknown_never_a_guess(tmp_path, monkeypatch):
    copy = tmp_path / "bench"
    copy.mkdir()
    shutil.copy(BENCH / "provenance.py", copy / "provenance.py")
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))  # no repository above the copy either
    monkeypatch.delenv("BENCH_COMMIT", raising=False)
    assert _fresh_provenance(copy, "bench_provenance_copy").current_commit() == "unknown"
    monkeypatch.setenv("BENCH_COMMIT", "abc1234")
    assert _fresh_provenance(copy, "bench_provenance_copy_env").current_commit() == "abc1234"


def test_bench_commit_names_the_code_even_inside_a_checkout(monkeypatch):
    """A tree copied to a GPU machine may carry a stale .git; the commit its runner names wins."""
    monkeypatch.setenv("BENCH_COMMIT", "fedcba9")
    assert _fresh_provenance(BENCH, "bench_provenance_env_wins").current_commit() == "fedcba9"


def test_every_benchmark_that_prints_rows_passes_them_through_with_provenance():
    printing = [p for p in sorted(BENCH.glob("*.py")) if p.name != "provenance.py" and "json.dumps" in p.read_text()]
    assert len(printing) >= 10, printing
    missing = [p.name for p in printing if "with_provenance(" not in p.read_text()]
    assert not missing, missing
