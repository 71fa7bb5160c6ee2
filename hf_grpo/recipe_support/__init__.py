"""What the scripts under ``recipes/`` share: argument parsing and launch, tasks and their rewards, tiny
models built in code, metrics files and plots.

``launch`` parses a recipe's arguments and runs it, ``recipe_args`` holds the arguments every recipe takes,
``tasks`` builds the datasets, ``rewards`` scores completions (``answer_parsing`` reads answers out of them,
``math_answers`` compares math answers, with math-verify when the ``math`` extra is installed),
``tiny`` builds tiny models and tokenizers (``diffusion_tiny`` the bidirectional ones, ``diffusion_launch`` runs
the diffusion recipes), ``reporting`` draws the reward plot (the trainer writes
``metrics.jsonl``: ``hf_grpo.run_files``).

May import anything in ``hf_grpo`` (this is the top of the stack); nothing in ``hf_grpo`` but the command line
imports it (``tests/project/test_layering.py`` checks that no feature package does).
"""
