"""Every command in the ```bash blocks of README.md, docs/*.md and bench/README.md, run as a user runs it, on this CPU.

``REGISTRY`` maps each documented command (its exact text, whitespace-normalised, ``\\`` continuations
joined, a trailing ``# comment`` dropped) to what the test does with it:

- ``Run``: the command itself, through ``bash -c`` from the repository root with this virtualenv's
  ``bin`` first on PATH (what ``. .venv/bin/activate`` does), after the listed substitutions
  (placeholders the user fills in, CPU stand-ins, each with its reason) and with flags appended that
  only keep it short (``--max_steps 2``, an ``--output_dir`` in tmp). ``offline`` says why the command
  as written cannot run here; the test then runs this closest offline variant. A plain one-process
  ``hf-grpo ...`` or ``python recipes/X.py ...`` runs in the test process instead, with the same argv,
  environment and directory (tests/in_process.py).
- ``NotRun``: why it is not run, and ``check``: what is verified instead.

The set of documented commands must equal the registry's keys (``test_every_documented_command_is_registered``):
a command added to the docs fails that test until a registry line says how to run it.

Nothing here passes ``--use_cpu true`` or ``--mixed_precision no``: the recipes pick the CPU by themselves
when there is no GPU, and the test checks what the user's command does.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from typing import Callable

import pytest
from tests.in_process import run_hf_grpo, run_recipe
from tests.launching import start_launch
from tests.side_by_side import free_port, wait_for_all

ROOT = pathlib.Path(__file__).resolve().parents[2]
BIN = pathlib.Path(sys.executable).parent  # the virtualenv's bin: accelerate, hf-grpo, python
# Every page a user reads: a page added to docs/ is covered without a line here.
DOCS = ("README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md")), "bench/README.md")
# ~20 s warm; a DeepSpeed launch JIT-builds its CPU comm op (~1.5 min) when the build cache is cold
LAUNCH_TIMEOUT_S = 600

# What a user passes to keep a run short. Everything else stays as documented.
SHORT = "--max_steps 2 --logging_steps 1 --disable_tqdm true --output_dir {tmp}/out"


# ---- reading the docs ------------------------------------------------------------------------------

@dataclass(frozen=True)
class Documented:
    command: str  # whitespace-normalised; a heredoc keeps its body lines after "\n"
    shown_block: str | None = None  # a plain ``` block right after the bash block: the output it prints
    shown_comment: str | None = None  # comment lines right after the command in its block: its output's start


def _strip_comment(line: str) -> str:
    """Drop an unquoted ``# ...`` that starts a word (a shell comment)."""
    quote = None
    for i, char in enumerate(line):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i]
    return line


def _normalise(text: str) -> str:
    return " ".join(text.split())


def documented_commands(markdown: str) -> list[Documented]:
    """Commands of the ```bash blocks, in order: one a line, ``\\`` continues, blank lines and comments skipped."""
    lines = markdown.splitlines()
    found: list[Documented] = []
    i = 0
    while i < len(lines):
        fence = lines[i].strip()
        if not fence.startswith("```"):
            i += 1
            continue
        language = fence[3:].strip()
        end = next(j for j in range(i + 1, len(lines)) if lines[j].strip().startswith("```"))
        if language == "bash":
            block = _bash_block(lines[i + 1:end])
            # a plain ``` block after only blank lines shows what the block's last command prints
            following = end + 1
            while following < len(lines) and not lines[following].strip():
                following += 1
            if block and following < len(lines) and lines[following].strip() == "```":
                shown_end = next(j for j in range(following + 1, len(lines)) if lines[j].strip().startswith("```"))
                shown = "\n".join(lines[following + 1:shown_end]) + "\n"
                block[-1] = Documented(block[-1].command, shown_block=shown, shown_comment=block[-1].shown_comment)
            found += block
        i = end + 1
    return found


def _bash_block(lines: list[str]) -> list[Documented]:
    commands: list[Documented] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        i += 1
        if not line.strip() or line.strip().startswith("#"):
            continue
        while line.rstrip().endswith("\\") and i < len(lines):
            line = line.rstrip()[:-1] + " " + lines[i]
            i += 1
        command = _normalise(_strip_comment(line))
        heredoc = re.search(r"<<-?\s*(['\"]?)(\w+)\1", command)
        if heredoc:
            body = []
            while i < len(lines) and lines[i].strip() != heredoc.group(2):
                body.append(lines[i].rstrip())
                i += 1
            i += 1
            command = "\n".join([command, *body, heredoc.group(2)])
        comment = []
        while i < len(lines) and lines[i].strip().startswith("#"):
            comment.append(lines[i].strip().lstrip("#").strip())
            i += 1
        commands.append(Documented(command, shown_comment="\n".join(comment) or None))
    return commands


DOCUMENTED = {doc: documented_commands((ROOT / doc).read_text()) for doc in DOCS}


# ---- running a command -----------------------------------------------------------------------------

@dataclass
class Ran:
    command: str  # what ran, after substitutions
    tmp: pathlib.Path
    documented: Documented
    stdout: str = ""  # node 0's for a two-node run
    stderr: str = ""
    other_stderr: str = ""  # node 1's


@dataclass(frozen=True)
class Sub:
    old: str
    new: str
    why: str


@dataclass(frozen=True)
class Run:
    check: Callable[[Ran], None]
    append: str = ""
    replace: tuple[Sub, ...] = ()
    offline: str = ""  # why the command as written cannot run here: what runs is the closest offline variant
    nodes: int = 1  # 2: two processes side by side, NODE_RANK=0 and 1, MAIN_IP=127.0.0.1
    processes: int = 1  # in all, over the nodes; 2 or more: the test is marked launch (tests/launching.py)
    cwd: str = "root"  # or "tmp": a command that writes into its working directory
    setup: Callable[[pathlib.Path], None] | None = None
    slow: bool = True
    timeout: int = LAUNCH_TIMEOUT_S


@dataclass(frozen=True)
class NotRun:
    why: str
    check: Callable[[Documented, pathlib.Path], None]  # what is verified instead


def clean_env(tmp: pathlib.Path) -> dict[str, str]:
    """This virtualenv activated; no launcher or DIFFU_* variables of the caller's; a fresh user's HF home."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("DIFFU_", "WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_", "ACCELERATE_"))}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env["VIRTUAL_ENV"] = sys.prefix
    # No ~/.cache/huggingface/accelerate/default_config.yaml (a bare `accelerate launch` reads it) and no hub
    # cache: what a user who has just installed gets. Offline: a hub access fails at once instead of retrying.
    env["HF_HOME"] = str(tmp / "hf_home")
    env["HF_HUB_OFFLINE"] = "1"
    return env


def _tail(text: str, chars: int = 6000) -> str:
    return text[-chars:] if text else "<empty>"


def run_documented(doc: Documented, run: Run, tmp: pathlib.Path) -> Ran:
    values = {"tmp": str(tmp), "port": str(free_port())}
    command = doc.command
    for sub in run.replace:
        assert sub.old in command, f"substitution {sub.old!r} no longer matches the documented command {command!r}"
        command = command.replace(sub.old, sub.new.format(**values))
    if run.append:
        command += " " + run.append.format(**values)
    cwd = tmp if run.cwd == "tmp" else ROOT
    if run.setup:
        run.setup(tmp)
    env = clean_env(tmp)
    if run.nodes > 1:
        env.update(MAIN_IP="127.0.0.1", OMP_NUM_THREADS="1")  # two single-process "nodes" share this machine
        if sys.platform.startswith("linux"):
            # gloo picks its interface from the hostname, which may not be reachable in a container
            env["GLOO_SOCKET_IFNAME"] = "lo"
    if _is_hf_grpo(command) and run.nodes == 1:
        return _run_hf_grpo_in_process(command, doc, run, tmp, cwd, env)
    if _python_recipe(command) and run.nodes == 1:
        return _run_recipe_in_process(command, doc, tmp, cwd, env)
    processes = []
    for rank in range(run.nodes):
        node_env = {**env, "NODE_RANK": str(rank)} if run.nodes > 1 else env
        out, err = tmp / f"node{rank}.out", tmp / f"node{rank}.err"
        with open(out, "w") as stdout, open(err, "w") as stderr:  # files, not pipes: a full pipe stalls a run
            processes.append(start_launch(["bash", "-c", command], processes=run.processes, cwd=cwd, env=node_env,
                                          stdout=stdout, stderr=stderr))
    problem = wait_for_all(processes, run.timeout)
    outputs = [((tmp / f"node{r}.out").read_text(errors="replace"), (tmp / f"node{r}.err").read_text(errors="replace"))
               for r in range(run.nodes)]
    if problem is not None:
        variant = f" (the closest offline variant: the command as written {run.offline})" if run.offline else ""
        pytest.fail(f"{command!r}{variant}: {problem}" + "".join(
            f"\n--- process {r} (exit {p.returncode}) stdout tail:\n{_tail(o, 2000)}\n--- stderr tail:\n{_tail(e)}"
            for r, (p, (o, e)) in enumerate(zip(processes, outputs))))
    return Ran(command, tmp, doc, stdout=outputs[0][0], stderr=outputs[0][1],
               other_stderr=outputs[1][1] if run.nodes > 1 else "")


def _is_hf_grpo(command: str) -> bool:
    """A plain ``hf-grpo ...`` command: no pipes, redirections, variables or chained commands for a shell to run."""
    return command.startswith("hf-grpo ") and not re.search(r"[|&;<>$`\n]", command)


def _python_recipe(command: str) -> str | None:
    """RECIPE of a plain ``python recipes/RECIPE.py ARGS`` (one process, nothing for a shell to run), else None."""
    match = re.fullmatch(r"python recipes/(\w+)\.py( .*)?", command)
    return match.group(1) if match and not re.search(r"[|&;<>$`\n]", command) else None


def _run_recipe_in_process(command: str, doc: Documented, tmp: pathlib.Path, cwd: pathlib.Path,
                           env: dict[str, str]) -> Ran:
    """The recipe's main with the argv a shell gives ``python recipes/RECIPE.py``, in the same environment and
    directory (tests/in_process.py: ~10 s of imports saved; the README's ``accelerate launch recipes/quickstart.py``
    is launched as written)."""
    result = run_recipe(_python_recipe(command), shlex.split(command)[2:], env=env, cwd=cwd)
    if result.returncode != 0:
        pytest.fail(f"{command!r}: exit {result.returncode}\n--- stdout tail:\n{_tail(result.stdout, 2000)}"
                    f"\n--- stderr tail:\n{_tail(result.stderr)}")
    return Ran(command, tmp, doc, stdout=result.stdout, stderr=result.stderr)


def _run_hf_grpo_in_process(command: str, doc: Documented, run: Run, tmp: pathlib.Path, cwd: pathlib.Path,
                            env: dict[str, str]) -> Ran:
    """The CLI's main with the argv a shell gives the console script, in the same environment and directory
    (tests/in_process.py: a subprocess per command is ~5 s of imports; cli/test_cli.py runs the console script)."""
    result = run_hf_grpo(shlex.split(command)[1:], env=env, cwd=cwd)
    if result.returncode != 0:
        pytest.fail(f"{command!r}: exit {result.returncode}\n--- stdout tail:\n{_tail(result.stdout, 2000)}"
                    f"\n--- stderr tail:\n{_tail(result.stderr)}")
    return Ran(command, tmp, doc, stdout=result.stdout, stderr=result.stderr)


# ---- what a run must show --------------------------------------------------------------------------

def _metrics(directory: pathlib.Path) -> list[dict]:
    path = directory / "metrics.jsonl"
    assert path.exists(), f"no {path}"
    return [json.loads(line) for line in path.read_text().splitlines()]


FP32 = "no CUDA device: training in fp32, not the launch config's mixed_precision=bf16"


def trained(world: int, *keys: str, output: str = "out", final: str = "model.safetensors", bf16_config=False):
    """Two logged optimizer steps with finite losses, the batch plan of this world size, the files the README lists.
    ``bf16_config``: a shipped config says bf16; "on a machine without a GPU the recipes train in fp32 on the CPU
    and say so once" (docs/launch.md)."""

    def check(ran: Ran) -> None:
        assert f"hf-grpo batch plan (world size {world})" in ran.stderr, _tail(ran.stderr)
        if bf16_config:
            assert ran.stderr.count(FP32) == 1, _tail(ran.stderr)
        directory = ran.tmp / output
        rows = _metrics(directory)
        assert [row["step"] for row in rows] == [1, 2], rows
        assert all(math.isfinite(row["loss"]) for row in rows), rows
        assert all(0.0 <= row["reward"] <= 1.0 for row in rows), rows
        for key in keys:
            assert all(key in row for row in rows), (key, sorted(rows[0]))
        assert (directory / "reward_loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        per_rank = json.loads((directory / "performance.json").read_text())["per_rank"]
        assert len(per_rank) == world and all(rank["peak_memory_gib"] > 0 for rank in per_rank), per_rank
        assert (directory / final).exists(), sorted(p.name for p in directory.iterdir())

    return check


def quickstart_as_the_readme_describes(ran: Ran) -> None:
    """`What the main command shows`: the plan first, then metrics.jsonl, the plot, performance.json,
    a checkpoint and the final model (here after 2 steps instead of 100)."""
    trained(1)(ran)
    assert ran.stderr.index("hf-grpo batch plan") < ran.stderr.index("metrics:")
    assert (ran.tmp / "out" / "checkpoint-2").is_dir()  # saved at the last step


def two_nodes_as_one_world(ran: Ran) -> None:
    """Ranks are global: node 0 holds rank 0 of a 2-process world and alone writes the metrics."""
    trained(2, output="node0", bf16_config=True)(ran)
    assert "(64 per device x 2 devices)" in ran.stderr
    assert "hf-grpo batch plan" not in ran.other_stderr
    assert not (ran.tmp / "node1" / "metrics.jsonl").exists()


def wrote_the_hostfile(ran: Ran) -> None:
    assert (ran.tmp / "hostfile").read_text() == "node0 slots=8\nnode1 slots=8\n"


def prints_the_plan(ran: Ran) -> None:
    """`hf-grpo plan` exits 0 and prints the tree; where the docs show the output, it is exactly that."""
    assert ran.stdout.startswith("rollout: "), ran.stdout
    assert "└── log-softmax in chunks of" in ran.stdout
    if ran.documented.shown_block is not None:
        assert ran.stdout == ran.documented.shown_block
    if ran.documented.shown_comment is not None:
        assert ran.stdout.splitlines()[0] == ran.documented.shown_comment


def prints_the_translation(ran: Ran) -> None:
    """`hf-grpo plan --from` exits 0 and prints the flags, then the plan, exactly as the docs show them."""
    assert ran.stdout.startswith("hf-grpo flags (a recipe launched on "), ran.stdout
    assert "\nbatch plan:\nrollout: " in ran.stdout and "\nchecked against " in ran.stdout
    assert ran.documented.shown_block is not None and ran.stdout == ran.documented.shown_block


def translates_and_lists_the_rest(ran: Ran) -> None:
    """`hf-grpo plan --from` on a whole config exits 0, prints the translated flags and the plan, and lists the
    keys that are not batch settings once."""
    assert ran.stdout.startswith("hf-grpo flags (a recipe launched on "), ran.stdout
    assert "\nbatch plan:\nrollout: " in ran.stdout
    assert ran.stdout.count("not batch settings, ignored") == 1, ran.stdout


# ---- checks for what is not run --------------------------------------------------------------------

README_INSTALL = 'python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 -e ".[deepspeed,dev,math]"'


def _ci_commands() -> list[str]:
    lines = (ROOT / ".ci" / "run").read_text().splitlines()
    return [_normalise(line) for line in lines if line.strip() and not line.lstrip().startswith("#")]


LAUNCH = "python -m pytest tests -q -m launch"
CONVERGENCE = "python -m pytest tests -q -m convergence"


def the_ci_runs_it(doc: Documented, tmp: pathlib.Path) -> None:
    """.ci/run is the README's command, one `&&` part a line: its set-up (pip's -q aside), then the tests, then the
    multi-process launches and last the convergence tests, which the README's test command leaves out
    (docs/testing.md)."""
    parts = [part.strip() for part in doc.command.split("&&")]
    ci = _ci_commands()
    assert ci[-3:] == [parts[-1], LAUNCH, CONVERGENCE], (ci[-3:], parts[-1])
    quiet = [re.sub(r"^pip install -q ", "pip install ", line) for line in ci]
    for part in parts[:-1]:
        assert part in quiet, (part, ci)


def the_ci_runs_it_last(doc: Documented, tmp: pathlib.Path) -> None:
    """The convergence run is .ci/run's last command, after the README's and the launches."""
    assert _ci_commands()[-1] == doc.command == CONVERGENCE, _ci_commands()[-2:]


def the_ci_runs_it_after_the_readmes(doc: Documented, tmp: pathlib.Path) -> None:
    """The launch run follows the README's command in .ci/run, before the convergence run."""
    assert _ci_commands()[-3:] == ["python -m pytest tests -q", doc.command, CONVERGENCE] and doc.command == LAUNCH, \
        _ci_commands()[-3:]


def the_pdsh_launch_reaches_deepspeeds_runner(doc: Documented, tmp: pathlib.Path) -> None:
    """Needs pdsh and passwordless ssh to hosts node0 and node1. Instead: the same command, from a directory holding
    the hostfile (as the docs' block writes it) and the repository's configs and recipes, with a stand-in
    `deepspeed` on PATH that records how accelerate calls it. It must get the hostfile and the pdsh launcher,
    and ./.deepspeed_env must carry node 0's NCCL_* settings, as the docs say."""
    (tmp / "hostfile").write_text("node0 slots=8\nnode1 slots=8\n")
    for name in ("accelerate_configs", "recipes"):
        (tmp / name).symlink_to(ROOT / name)
    stub = tmp / "stub"
    stub.mkdir()
    (stub / "deepspeed").write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > {tmp}/deepspeed_argv\n')
    (stub / "deepspeed").chmod(0o755)
    env = clean_env(tmp)
    env.update(PATH=f"{stub}{os.pathsep}{env['PATH']}", MAIN_IP="127.0.0.1", NCCL_DEBUG="INFO")
    result = subprocess.run(["bash", "-c", doc.command], cwd=tmp, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, _tail(result.stderr)
    argv = (tmp / "deepspeed_argv").read_text().splitlines()
    assert argv[:5] == ["--hostfile", "hostfile", "--no_local_rank", "--launcher", "pdsh"], argv
    assert argv[argv.index("--master_addr") + 1] == "127.0.0.1" and "recipes/quickstart.py" in argv, argv
    assert "NCCL_DEBUG=INFO" in (tmp / ".deepspeed_env").read_text().splitlines()


def a_gpu_benchmark_as_its_script_reads_it(doc: Documented, tmp: pathlib.Path) -> None:
    """The bench/ script the command runs exists, defines every ``--flag`` the command passes, and (for a shell
    runner) reads every ``VAR=value`` set before it, so the documented command is one the script accepts."""
    words = shlex.split(doc.command)
    variables = []
    while words and re.fullmatch(r"[A-Z_]+=.*", words[0]):
        variables.append(words.pop(0).split("=", 1)[0])
    scripts = [w for w in words if w.startswith("bench/") and w.endswith((".py", ".sh"))]
    assert len(scripts) == 1, words
    source = (ROOT / scripts[0]).read_text()
    after = words[words.index(scripts[0]) + 1:]
    flags = [w for w in after if w.startswith("--")]
    unknown = [f for f in flags if f'"{f}"' not in source]
    assert not unknown, (scripts[0], unknown)
    unread = [v for v in variables if not re.search(rf"\$\{{?{v}\b", source)]
    assert not unread, (scripts[0], unread)
    if "accelerate launch" in doc.command:
        config = words[words.index("--config_file") + 1]
        assert (ROOT / config).exists(), config


def sets_a_variable_for_the_launch(doc: Documented, tmp: pathlib.Path) -> None:
    name, value = doc.command.removeprefix("export ").split("=", 1)
    result = subprocess.run(["bash", "-c", f"{doc.command} && printenv {name}"], capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout.strip() == value, result


def compiles_bytecode_under_the_prefix(doc: Documented, tmp: pathlib.Path) -> None:
    """The folder the command names is the one holding torch, and ``compileall`` with ``PYTHONPYCACHEPREFIX`` set
    writes the bytecode under the prefix (shown on a one-file folder instead of every installed package)."""
    inner = re.search(r"python -c '([^']*)'", doc.command).group(1)
    folder = subprocess.run([sys.executable, "-c", inner], capture_output=True, text=True, check=True).stdout.strip()
    assert (pathlib.Path(folder) / "torch" / "__init__.py").exists(), folder
    package = tmp / "package"
    package.mkdir()
    (package / "module.py").write_text("VALUE = 1\n")
    env = {**os.environ, "PYTHONPYCACHEPREFIX": str(tmp / "pyc")}
    command = doc.command.replace(doc.command[doc.command.index('"$('):], str(package)).split()
    subprocess.run([sys.executable if word == "python" else word for word in command], env=env, check=True)
    assert list((tmp / "pyc").rglob("module*.pyc")), sorted((tmp / "pyc").rglob("*"))


# ---- the registry ----------------------------------------------------------------------------------

def _verl_yaml(tmp: pathlib.Path) -> None:
    """A veRL trainer config (nested keys) under the two names docs/plan_from.md uses."""
    text = ("data:\n  train_batch_size: 64\n  max_response_length: 256\nactor_rollout_ref:\n  rollout:\n    n: 8\n"
            "  actor:\n    ppo_mini_batch_size: 32\n    ppo_micro_batch_size_per_gpu: 4\n    ppo_epochs: 1\n"
            "algorithm:\n  adv_estimator: grpo\ntrainer:\n  n_gpus_per_node: 1\n  nnodes: 1\n"
            "  logger: ['console', 'wandb']\n")
    for name in ("verl_ppo_trainer.yaml", "verl.yaml"):
        (tmp / name).write_text(text)


def _gsm8k_jsonl(tmp: pathlib.Path) -> None:
    rows = [{"question": f"What is {a} + {a}?", "answer": f"{a}+{a}={2 * a}\n#### {2 * a}"} for a in range(8)]
    (tmp / "gsm8k.jsonl").write_text("\n".join(json.dumps(row) for row in rows))


def _checkpoint(tmp: pathlib.Path) -> None:
    from hf_grpo.recipe_support.tiny import save_tiny_checkpoint

    save_tiny_checkpoint(tmp / "my-checkpoint")


def _checkpoint_and_gsm8k(tmp: pathlib.Path) -> None:
    _checkpoint(tmp)
    _gsm8k_jsonl(tmp)


NO_INSTALL = Sub(README_INSTALL + " && ", "",
                 "creating .venv and pip-installing is not repeated here (minutes, network): the test runs in the "
                 "virtualenv that line builds (test_this_virtualenv_is_what_the_install_line_builds)")
# The yaml says 16 processes over 2 machines (8 GPUs each); here each "node" is one CPU process.
ONE_PROCESS_PER_NODE = Sub("recipes/quickstart.py", "--num_processes 2 recipes/quickstart.py",
                           "16 processes (2 machines x 8 GPUs) -> 2: one CPU process per node")
# Node 0's port is the user's choice; 29500 may be taken on this machine by another launch (torch's default).
FREE_PORT = Sub("--main_process_port 29500", "--main_process_port {port}", "a free port instead of 29500")
NODE_OUTPUT = "--max_steps 2 --logging_steps 1 --disable_tqdm true --save_strategy no --output_dir {tmp}/node$NODE_RANK"
MULTI_NODE_CONFIG = ("accelerate launch --config_file accelerate_configs/multi_node_zero2.yaml "
                     "--machine_rank $NODE_RANK --main_process_ip $MAIN_IP --main_process_port 29500 recipes/quickstart.py")

# bench/README.md: GPU benchmarks. Their --tiny CPU smoke runs are tests of their own (memory/test_token_budget.py,
# memory/test_train_backoff.py, diffusion/test_diffu_sampler_exact.py); here, that each command is one its script
# accepts.
GPU_BENCHMARK = NotRun("a GPU benchmark (needs CUDA, minutes)", a_gpu_benchmark_as_its_script_reads_it)

REGISTRY: dict[str, dict[str, Run | NotRun]] = {
    "README.md": {
        # "The two commands", 1: the part after the install, as written, from the repository root
        README_INSTALL + " && accelerate launch recipes/quickstart.py":
            Run(quickstart_as_the_readme_describes, append=SHORT, replace=(NO_INSTALL,)),
        # "The two commands", 2: running the test suite from inside it would recurse
        README_INSTALL + " && python -m pytest tests -q":
            NotRun("runs this test suite (it would recurse); .ci/run runs exactly this, one part a line",
                   the_ci_runs_it),
        "python -m pytest tests -q":
            NotRun("runs this test suite (it would recurse); .ci/run runs it after the set-up", the_ci_runs_it),
        "accelerate launch --config_file accelerate_configs/zero2.yaml --num_processes 8 recipes/gsm8k.py "
        "--config recipes/gsm8k.yaml":
            Run(trained(2, "kl", "rewards/gsm8k_format_reward/mean", "rewards/gsm8k_correctness_reward/mean",
                        bf16_config=True),
                offline="needs the hub (model Qwen/Qwen2.5-0.5B-Instruct, dataset openai/gsm8k) and 8 GPUs",
                processes=2,
                setup=_checkpoint_and_gsm8k,
                replace=(Sub("--num_processes 8", "--num_processes 2", "2 CPU processes over gloo"),),
                # a saved checkpoint, not --tiny: gsm8k.yaml's beta 0.04 needs a reference model loaded from a path
                append=SHORT + " --model_name_or_path {tmp}/my-checkpoint --dataset_name {tmp}/gsm8k.jsonl"
                               " --max_completion_length 12 --save_strategy no"),
        MULTI_NODE_CONFIG:
            Run(two_nodes_as_one_world, nodes=2, processes=2, replace=(FREE_PORT, ONE_PROCESS_PER_NODE), append=NODE_OUTPUT,
                offline="needs 2 machines x 8 GPUs; run as 2 one-process 'nodes' on 127.0.0.1 "
                        "(NODE_RANK=0/1 side by side, MAIN_IP=127.0.0.1)"),
        # "Masked-diffusion models": the diffusion quickstart, as written
        "accelerate launch recipes/diffu_quickstart.py":
            Run(trained(1, "rewards/reward/mean"), append=SHORT),
    },
    "docs/batch_sizes.md": {
        "hf-grpo plan --per_device_train_batch_size 16 --num_generations 8 --gradient_accumulation_steps 4 "
        "--steps_per_generation 4 --per_device_generation_batch_size 8 --num_processes 8":
            Run(prints_the_plan, slow=False, timeout=120),
    },
    "docs/other_frameworks.md": {
        # one worked example per framework (tests/cli/test_translate.py checks the maths)
        "hf-grpo plan --from skyrl trainer.train_batch_size=256 generator.n_samples_per_prompt=8 "
        "trainer.policy_mini_batch_size=64 trainer.micro_train_batch_size_per_gpu=4 trainer.update_epochs_per_batch=1 "
        "trainer.placement.policy_num_gpus_per_node=8 generator.sampling_params.max_generate_length=1024":
            Run(prints_the_translation, slow=False, timeout=120),
        "hf-grpo plan --from verl data.train_batch_size=512 actor_rollout_ref.rollout.n=8 "
        "actor_rollout_ref.actor.ppo_mini_batch_size=128 actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8 "
        "actor_rollout_ref.actor.ppo_epochs=1 trainer.n_gpus_per_node=8 trainer.nnodes=1 data.max_response_length=1024":
            Run(prints_the_translation, slow=False, timeout=120),
        "hf-grpo plan --from openrlhf rollout_batch_size=128 n_samples_per_prompt=8 train_batch_size=256 "
        "micro_train_batch_size=4 micro_rollout_batch_size=32 max_epochs=1 actor_num_gpus_per_node=8 "
        "generate_max_len=1024":
            Run(prints_the_translation, slow=False, timeout=120),
        "hf-grpo plan --from trlx --num_processes 2 --num_generations 8 train.batch_size=32 train.minibatch_size=8 "
        "method.num_rollouts=128 method.chunk_size=64 method.ppo_epochs=4 method.gen_kwargs.max_new_tokens=256":
            Run(prints_the_translation, slow=False, timeout=120),
        "hf-grpo plan --from d1 --num_processes 2 per_device_train_batch_size=8 gradient_accumulation_steps=2 "
        "num_generations=8 num_iterations=4 generation_batch_size=4 max_completion_length=256 block_length=32 "
        "diffusion_steps=128":
            Run(prints_the_translation, slow=False, timeout=120),
    },
    "docs/plan_from.md": {
        "hf-grpo plan --from verl --config verl_ppo_trainer.yaml":
            Run(translates_and_lists_the_rest, setup=_verl_yaml, cwd="tmp", slow=False, timeout=120),
        "hf-grpo plan --from verl data.train_batch_size=64 actor_rollout_ref.rollout.n=8 "
        "actor_rollout_ref.actor.ppo_mini_batch_size=32 actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4 "
        "algorithm.adv_estimator=grpo trainer.logger=\"['console','wandb']\"":
            Run(translates_and_lists_the_rest, slow=False, timeout=120),
        "hf-grpo plan --from verl --config verl.yaml rollout.n=4":
            Run(translates_and_lists_the_rest, setup=_verl_yaml, cwd="tmp", slow=False, timeout=120),
    },
    "docs/models.md": {
        "python recipes/countdown.py --model_name_or_path ./my-checkpoint --use_peft true --lora_r 16 --lora_alpha 32 "
        "--beta 0.04":
            Run(trained(1, "kl", "rewards/countdown_reward/mean", final="adapter_model.safetensors"),
                setup=_checkpoint,
                replace=(Sub("./my-checkpoint", "{tmp}/my-checkpoint",
                             "a checkpoint directory written by hf_grpo.recipe_support.tiny.save_tiny_checkpoint"),),
                append=SHORT + " --max_completion_length 12 --num_train_samples 64"),
    },
    "docs/testing.md": {
        LAUNCH:
            NotRun("runs this test suite's multi-process launches (minutes; it would recurse); .ci/run runs it after "
                   "the README's command", the_ci_runs_it_after_the_readmes),
        CONVERGENCE:
            NotRun("runs this test suite's convergence tests (minutes; it would recurse); .ci/run runs it last",
                   the_ci_runs_it_last),
    },
    "docs/multi_node.md": {
        "export MAIN_IP=10.0.0.1":
            NotRun("node 0's address for the launch below it (10.0.0.1 is a placeholder); the two-node run here "
                   "sets MAIN_IP=127.0.0.1. Checked: the line sets it", sets_a_variable_for_the_launch),
        MULTI_NODE_CONFIG + " --config recipes/quickstart.yaml":
            Run(two_nodes_as_one_world, nodes=2, processes=2, replace=(FREE_PORT, ONE_PROCESS_PER_NODE), append=NODE_OUTPUT,
                offline="needs 2 machines x 8 GPUs; run as 2 one-process 'nodes' on 127.0.0.1"),
        "export NCCL_SOCKET_IFNAME=eth0":
            NotRun("NCCL network setting for a GPU cluster (no NCCL here)", sets_a_variable_for_the_launch),
        "export GLOO_SOCKET_IFNAME=eth0":
            NotRun("this machine's interface is not eth0; the two-node runs here set GLOO_SOCKET_IFNAME=lo",
                   sets_a_variable_for_the_launch),
        "export NCCL_DEBUG=INFO":
            NotRun("NCCL logging (no NCCL here)", sets_a_variable_for_the_launch),
        "cat > hostfile <<EOF\nnode0 slots=8\nnode1 slots=8\nEOF":
            Run(wrote_the_hostfile, cwd="tmp", slow=False, timeout=60),
        "accelerate launch --config_file accelerate_configs/multi_node_zero2.yaml --deepspeed_multinode_launcher pdsh "
        "--deepspeed_hostfile hostfile --main_process_ip $MAIN_IP --main_process_port 29500 recipes/quickstart.py":
            NotRun("needs pdsh, passwordless ssh to hosts node0 and node1, and GPUs",
                   the_pdsh_launch_reaches_deepspeeds_runner),
        "hf-grpo plan --config recipes/quickstart.yaml --num_processes 16 --per_device_train_batch_size 32":
            Run(prints_the_plan, slow=False, timeout=120),
    },
    "bench/README.md": {
        'STEPS=20 MAX_SECONDS=600 RUN_TIMEOUT=600 IMPLS="trl cuda_graph" bash bench/run_realistic.sh':
            GPU_BENCHMARK,
        'STEPS=20 MAX_SECONDS=600 RUN_TIMEOUT=600 IMPLS="trl cuda_graph no_shape_reuse" bash bench/run_realistic.sh':
            GPU_BENCHMARK,
        'python bench/grpo_realistic.py --impl hf_grpo --backend cuda_graph --profile_step 5':
            GPU_BENCHMARK,
        "python bench/grpo_realistic.py --impl hf_grpo --eos_prob 0 --shape 1.5b --max_completion_length 4096 "
        "--max_steps 1": GPU_BENCHMARK,
        "for impl in trl hf_grpo; do TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) python bench/grpo_realistic.py --impl $impl "
        "--shape 1.5b --lora_r 16 --min_prompt 64 --max_prompt 1024 --max_completion_length 512 --max_steps 6 "
        "--per_device_generation_batch_size 32 --phases --max_seconds 240 --label \"1.5B LoRA r16, $impl\" "
        "--out bench/results/raw/grpo_lora.jsonl; done":
            GPU_BENCHMARK,
        "for impl in trl hf_grpo; do TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) python bench/grpo_realistic.py --impl $impl "
        "--shape 0.5b --num_iterations 2 --max_steps 10 --phases --max_seconds 240 --label \"num_iterations 2, $impl\" "
        "--out bench/results/raw/grpo_ni2.jsonl; done":
            GPU_BENCHMARK,
        "export PYTHONPYCACHEPREFIX=/tmp/pyc":
            NotRun("sets the bytecode folder of the GPU runs that follow", sets_a_variable_for_the_launch),
        "python -m compileall -q -j 16 \"$(python -c 'import torch, os; "
        "print(os.path.dirname(os.path.dirname(torch.__file__)))')\"":
            NotRun("compiles every installed package's bytecode (minutes on two cores); the GPU runs did",
                   compiles_bytecode_under_the_prefix),
        'python bench/cold_start.py --compile-cache-dir /tmp/cold1 --label cold --out bench/results/raw/cold_start.jsonl':
            GPU_BENCHMARK,
        'python bench/cold_start.py --compile-cache-dir /tmp/cold1 --label warm --out bench/results/raw/cold_start.jsonl':
            GPU_BENCHMARK,
        'python bench/cold_start.py --compile-cache-dir /tmp/cold2 --warm-pool-before 6 --label "workers early" '
        '--out bench/results/raw/cold_start.jsonl':
            GPU_BENCHMARK,
        'python bench/graph_shapes.py --steps 500 --out bench/results/raw/graph_shapes.jsonl':
            NotRun("a CPU simulation of 500 steps (about a minute); training/test_training_graphs.py runs it for "
                   "6 steps",
                   a_gpu_benchmark_as_its_script_reads_it),
        'python bench/rollout.py --repeats 2 --out bench/results/raw/rollout.json':
            GPU_BENCHMARK,
        "python bench/decode_profile.py --shape 1.5b --batch 128 --prompt-len 64 --rollout-timeline "
        "--out bench/results/raw/decode_profile.jsonl":
            GPU_BENCHMARK,
        'python bench/decode_attention.py --sweep --out bench/results/raw/decode_attention.jsonl':
            GPU_BENCHMARK,
        'python bench/decode_attention.py --lengths 1024,4096,16384,32768 '
        '--out bench/results/raw/decode_attention_long.jsonl':
            GPU_BENCHMARK,
        'python bench/kernel_resources.py --out bench/results/raw/kernel_resources.jsonl':
            NotRun("needs Triton, not a dependency of the project", a_gpu_benchmark_as_its_script_reads_it),
        'python bench/kernel_resources.py --shared-prompts --out bench/results/raw/kernel_resources.jsonl':
            NotRun("needs Triton, not a dependency of the project", a_gpu_benchmark_as_its_script_reads_it),
        'python bench/long_context.py --shape 7b --lora_r 16 --num_generations 8 --lengths 20480 --steps 2 '
        '--out bench/results/raw/long_context_20k.jsonl':
            GPU_BENCHMARK,
        'python bench/long_context.py --shape 7b --lora_r 16 --num_generations 8 --lengths 8192,16384,20480,32768 '
        '--out bench/results/raw/long_context.jsonl':
            GPU_BENCHMARK,
        'for len in 512 4096; do python bench/rollout.py --shapes 0.5b --completions 32 --completion-len $len '
        '--prompt-len 256 --backends cuda_graph,cuda_graph_matmul --out bench/results/raw/rollout_$len.json; done':
            GPU_BENCHMARK,
        'python bench/logprobs.py --hidden 896 --tokens 8192 65536 --chunk-rows 1024 4096 --impls chunked trl':
            GPU_BENCHMARK,
        "bash bench/run_launch_configs.sh":
            GPU_BENCHMARK,
        'IMPLS="hf_grpo_padded hf_grpo_packed" bash bench/run_launch_configs.sh':
            GPU_BENCHMARK,
        'CONFIGS=zero2 IMPLS="hf_grpo_padded hf_grpo_packed trl" TOTAL_SECONDS=510 bash bench/run_launch_configs.sh':
            GPU_BENCHMARK,
        'CONFIGS=multi_gpu PROCESS_COUNTS="1 2" IMPLS=hf_grpo bash bench/run_launch_configs.sh':
            GPU_BENCHMARK,
        'CONFIGS=multi_gpu PROCESS_COUNTS=2 IMPLS=trl RUN_TIMEOUT=320 STARTUP=120 bash bench/run_launch_configs.sh':
            GPU_BENCHMARK,
        'SHAPE=7b-lora CONFIGS=zero2 IMPLS="hf_grpo trl" EXTRA="--eos_prob 0 --full_length" STEPS=3 STEPS_trl=2 '
        'RUN_TIMEOUT_hf_grpo=190 RUN_TIMEOUT_trl=300 bash bench/run_launch_configs.sh':
            GPU_BENCHMARK,
        'SHAPE=7b-lora CONFIGS=zero2 IMPLS="hf_grpo trl_cb" EXTRA="--eos_prob 0 --full_length" STEPS=3 STEPS_trl_cb=2 '
        'RUN_TIMEOUT_hf_grpo=190 RUN_TIMEOUT_trl_cb=360 bash bench/run_launch_configs.sh':
            GPU_BENCHMARK,
        'SHAPE=7b-lora CONFIGS=zero2 IMPLS=hf_grpo EXTRA="--eos_prob 0 --full_length --compile_training on" STEPS=3 '
        'RUN_TIMEOUT=220 STARTUP=110 bash bench/run_launch_configs.sh':
            GPU_BENCHMARK,
        "bash bench/run_launch_configs.sh --tiny":
            NotRun("two CPU launches of minutes each (the smoke run of the GPU benchmark above)",
                   a_gpu_benchmark_as_its_script_reads_it),
        'STEPS=6 CONFIGS="zero2 zero3" bash bench/run_multi_gpu.sh':
            GPU_BENCHMARK,
        'STEPS=7 CONFIGS=zero3 TAG=leaves_off EXTRA="--zero3_leaf_modules off" bash bench/run_multi_gpu.sh':
            GPU_BENCHMARK,
        'python bench/autotune.py --scenario all --out bench/results/raw/autotune.jsonl':
            GPU_BENCHMARK,
        'python bench/autotune.py --scenario oom_train --out bench/results/raw/autotune_oom_train.jsonl':
            GPU_BENCHMARK,
        'accelerate launch --config_file accelerate_configs/multi_gpu.yaml --num_processes 2 bench/oom_two_gpus.py':
            GPU_BENCHMARK,
        'python bench/token_budget.py --out bench/results/raw/token_budget.jsonl':
            GPU_BENCHMARK,
        "python bench/diffu_llada.py --caches dual --rollout-tensor-batch 1024 "
        "--out bench/results/raw/diffu_llada_t1024.jsonl":
            GPU_BENCHMARK,
        "python bench/diffu_llada.py --caches dual --rollout-tensor-batch 512 "
        "--out bench/results/raw/diffu_llada_t512.jsonl":
            GPU_BENCHMARK,
    },
}


# ---- the tests -------------------------------------------------------------------------------------

def test_every_documented_command_is_registered():
    problems = [f"REGISTRY names a page that is not among the docs: {doc}" for doc in REGISTRY if doc not in DOCS]
    for doc in DOCS:
        documented = [d.command for d in DOCUMENTED[doc]]
        registered = REGISTRY.get(doc, {})
        missing = [c for c in documented if c not in registered]
        stale = [c for c in registered if c not in documented]
        problems += [f"{doc}: not in REGISTRY (add a line saying how the test runs it): {c!r}" for c in missing]
        problems += [f"{doc}: REGISTRY key no longer documented: {c!r}" for c in stale]
    assert not problems, "\n".join(problems)


def _id(doc: str, index: int, command: str) -> str:
    last = command.split("&&")[-1].split("\n")[0]
    page = doc.removesuffix(".md").replace("/", "-")
    return f"{page}-{index}-" + re.sub(r"[^A-Za-z0-9._]+", "-", last).strip("-")[:60]


def _cases():
    for doc in DOCS:
        for index, documented in enumerate(DOCUMENTED[doc]):
            entry = REGISTRY.get(doc, {}).get(documented.command)
            if entry is None:
                continue  # reported by test_every_documented_command_is_registered
            slow = isinstance(entry, Run) and entry.slow
            launch = isinstance(entry, Run) and entry.processes >= 2
            marks = [pytest.mark.slow] * slow + [pytest.mark.launch] * launch
            yield pytest.param(doc, documented, marks=marks,
                               id=_id(doc, index, documented.command))


@pytest.mark.parametrize("doc, documented", list(_cases()))
def test_documented_command(doc, documented, tmp_path):
    entry = REGISTRY[doc][documented.command]
    if isinstance(entry, NotRun):
        entry.check(documented, tmp_path)
    else:
        entry.check(run_documented(documented, entry, tmp_path))


def test_this_virtualenv_is_what_the_install_line_builds():
    """The set-up part of the README's two commands, not re-run: the virtualenv the tests run in must be what it
    builds (the pinned torch where it is a CPU build, the project installed editable from this checkout with the
    extras it names, the console scripts the README's commands call)."""
    import importlib.metadata

    import torch

    import hf_grpo

    pin = re.search(r"torch==(\S+)", README_INSTALL).group(1)
    if torch.version.cuda is None:  # on a GPU machine the README says to install its CUDA build instead
        assert torch.__version__.split("+")[0] == pin, torch.__version__
    assert pathlib.Path(hf_grpo.__file__).resolve().parent == ROOT / "hf_grpo"
    requires = importlib.metadata.requires("hf-grpo") or []
    for extra in re.search(r'-e "\.\[([\w,]+)\]"', README_INSTALL).group(1).split(","):
        for requirement in (r for r in requires if f'extra == "{extra}"' in r):
            name = re.match(r"[A-Za-z0-9_.-]+", requirement).group(0)
            importlib.metadata.version(name)  # raises if the extra's package is missing
    for script in ("accelerate", "hf-grpo", "python"):
        assert (BIN / script).exists(), script


def test_the_readme_install_line_is_parsed_as_documented():
    """README_INSTALL is shared by two registry keys: it must still be the README's set-up prefix."""
    two = [d.command for d in DOCUMENTED["README.md"] if "&&" in d.command]
    assert two and all(c.startswith(README_INSTALL + " && ") for c in two), two


def test_the_parser_reads_continuations_heredocs_comments_and_shown_output():
    text = "\n".join([
        "```bash", "# a comment", "", "export A=1   # trailing", "cmd --x 1 \\", "    --y '# kept' 2", "# out line",
        "cat > f <<EOF", "a b", "EOF", "last", "```", "", "```", "printed", "```",
    ])
    assert documented_commands(text) == [
        Documented("export A=1"),
        Documented("cmd --x 1 --y '# kept' 2", shown_comment="out line"),
        Documented("cat > f <<EOF\na b\nEOF"),
        Documented("last", shown_block="printed\n"),
    ]
    assert shlex.split("cmd --y '# kept' 2")[2] == "# kept"
