"""``hf-grpo`` commands and one-process recipe runs (``python recipes/X.py ARGS``) inside the test process: exit
code, stdout and stderr as a subprocess would give them.

A subprocess pays ~5-10 s of Python start-up and imports per command on a 2-core machine; in-process the
imports are paid once. ``tests/cli/test_cli.py::test_console_script_is_installed`` still runs the installed
console script itself, and the README's ``accelerate launch recipes/quickstart.py`` is launched as written
(``tests/project/test_readme_commands.py``).
"""

from __future__ import annotations

import io
import logging
import os
import subprocess
import sys
import traceback
from collections.abc import Mapping, Sequence
from contextlib import contextmanager, redirect_stderr, redirect_stdout

from tests.project_files import load_recipe


def run_hf_grpo(argv: Sequence[str], env: Mapping[str, str] | None = None,
                cwd: str | os.PathLike | None = None) -> subprocess.CompletedProcess:
    """``hf-grpo ARGV`` with ``env`` as the whole environment (default: this one) and ``cwd`` as the working
    directory; both are restored afterwards. An ``argparse`` exit (``--help``, a usage error) is its exit code."""
    from hf_grpo.cli.main import main

    stdout, stderr = io.StringIO(), io.StringIO()
    with _environment(env, cwd), redirect_stdout(stdout), redirect_stderr(stderr):
        try:
            code = main(list(argv))
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    return subprocess.CompletedProcess(["hf-grpo", *argv], code, stdout.getvalue(), stderr.getvalue())


def run_recipe(recipe: str, argv: Sequence, env: Mapping[str, str] | None = None,
               cwd: str | os.PathLike | None = None) -> subprocess.CompletedProcess:
    """``python recipes/RECIPE.py ARGV`` as the recipe's ``main(ARGV)``, with ``env`` and ``cwd`` as
    ``run_hf_grpo`` takes them. stderr holds the log records, formatted as the recipes' ``logging.basicConfig``
    writes them (the batch plan, the fp32 warning), then what was written to the stream; an exception gives exit
    code 1 and its traceback at stderr's end, as Python's would."""
    argv = [str(arg) for arg in argv]
    stdout, stderr = io.StringIO(), io.StringIO()
    with _environment(env, cwd), _records() as records, redirect_stdout(stdout), redirect_stderr(stderr):
        try:
            load_recipe(recipe).main(argv)
            code = 0
        except Exception:  # noqa: BLE001 (a subprocess would exit 1 printing this traceback)
            code = 1
            traceback.print_exc(file=sys.stderr)
    return subprocess.CompletedProcess(["python", f"recipes/{recipe}.py", *argv], code, stdout.getvalue(),
                                       "".join(line + "\n" for line in records) + stderr.getvalue())


@contextmanager
def _environment(env: Mapping[str, str] | None, cwd: str | os.PathLike | None):
    saved_env, saved_cwd = dict(os.environ), os.getcwd()
    try:
        if env is not None:
            os.environ.clear()
            os.environ.update(env)
        if cwd is not None:
            os.chdir(cwd)
        yield
    finally:
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_env)


@contextmanager
def _records():
    """The formatted lines of every log record that reaches the root logger meanwhile."""
    lines: list[str] = []
    formatter = logging.Formatter("%(asctime)s %(name)s: %(message)s")

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(formatter.format(record))

    handler = Collect()
    logging.getLogger().addHandler(handler)
    try:
        yield lines
    finally:
        logging.getLogger().removeHandler(handler)
