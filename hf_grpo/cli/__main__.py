"""``python -m hf_grpo.cli`` runs the ``hf-grpo`` command."""

from .main import main

raise SystemExit(main())
