"""The FutureWarnings that hf_grpo's own code causes, told apart from those of the libraries under it.

transformers warns from inside the deprecated function (``warnings.warn`` without a ``stacklevel``), so a warning's
file is transformers' own; what matters is the line that called the deprecated name: the first frame, going out
from the warning, outside transformers (and peft, whose model wrappers forward attribute reads to the model). A
deprecated name that TRL's own code calls (TRL 1.16 still uses the ``gradient_checkpointing*`` names) is TRL's.
"""

from __future__ import annotations

import contextlib
import os
import traceback
import warnings

import peft
import transformers

import hf_grpo

PACKAGE = os.path.dirname(hf_grpo.__file__) + os.sep
PROVIDERS = tuple(os.path.dirname(module.__file__) + os.sep for module in (transformers, peft))


@contextlib.contextmanager
def future_warnings_from_hf_grpo():
    """Yields a list that collects ``"file:line: message"`` for each FutureWarning issued inside the block from a
    file under ``hf_grpo/``, or by a deprecated name that a line under ``hf_grpo/`` called."""
    ours: list[str] = []

    def record(message, category, filename, lineno, file=None, line=None):
        if not issubclass(category, FutureWarning):
            return
        frames = [f for f in traceback.extract_stack()[:-1] if f.filename != warnings.__file__]
        caller = next((f for f in reversed(frames) if not f.filename.startswith(PROVIDERS)), None)
        if filename.startswith(PACKAGE):
            ours.append(f"{filename}:{lineno}: {message}")
        elif caller is not None and caller.filename.startswith(PACKAGE):
            ours.append(f"{caller.filename}:{caller.lineno}: {message}")

    with warnings.catch_warnings():
        warnings.simplefilter("always")  # every occurrence reaches record, not only the first per line
        warnings.showwarning = record
        yield ours
