"""``hf-grpo`` commands run inside the test process: exit code, stdout and stderr as a subprocess would give them.

A subprocess pays ~5 s of Python start-up and imports per command on a 2-core machine; in-process the
imports are paid once. ``tests/test_cli.py::test_console_script_is_installed`` still runs the installed
console script itself.
"""

from __future__ import annotations

import io
import os
import subprocess
from collections.abc import Mapping, Sequence
from contextlib import redirect_stderr, redirect_stdout


def run_hf_grpo(argv: Sequence[str], env: Mapping[str, str] | None = None,
                cwd: str | os.PathLike | None = None) -> subprocess.CompletedProcess:
    """``hf-grpo ARGV`` with ``env`` as the whole environment (default: this one) and ``cwd`` as the working
    directory; both are restored afterwards. An ``argparse`` exit (``--help``, a usage error) is its exit code."""
    from hf_grpo.cli.main import main

    stdout, stderr = io.StringIO(), io.StringIO()
    saved_env, saved_cwd = dict(os.environ), os.getcwd()
    try:
        if env is not None:
            os.environ.clear()
            os.environ.update(env)
        if cwd is not None:
            os.chdir(cwd)
        with redirect_stdout(stdout), redirect_stderr(stderr):
            try:
                code = main(list(argv))
            except SystemExit as exit_:
                code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    finally:
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_env)
    return subprocess.CompletedProcess(["hf-grpo", *argv], code, stdout.getvalue(), stderr.getvalue())
