"""``python -m hf_grpo`` runs the ``hf-grpo`` command (``hf_grpo.cli.main``), e.g. ``python -m hf_grpo plan``."""

from .cli.main import main

raise SystemExit(main())
