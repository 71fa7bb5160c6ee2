"""The multi-node launch configs, run on this machine as two "nodes" of one process each over gloo.

Each node is its own ``accelerate launch`` (as on real machines: one command per node, differing only in
``--machine_rank``), both pointing at 127.0.0.1. They must rendezvous into one world of 2 processes.
"""

import json
import math
import os
import pathlib
import sys

import pytest
import yaml
from tests.launching import accelerate_command, start_launch
from tests.side_by_side import free_port, wait_for_all

ROOT = pathlib.Path(__file__).resolve().parents[2]
MULTI_NODE_YAML = sorted((ROOT / "accelerate_configs").glob("multi_node*.yaml"))
LAUNCH_TIMEOUT_S = 600  # ~20 s warm; the first DeepSpeed launch on a machine JIT-builds its CPU comm op (~1.5 min)
pytestmark = pytest.mark.slow


def test_the_multi_node_configs_are_shipped():
    assert {p.stem for p in MULTI_NODE_YAML} >= {"multi_node", "multi_node_zero2"}


@pytest.mark.parametrize("path", MULTI_NODE_YAML, ids=lambda p: p.name)
def test_multi_node_yaml_starts_with_its_per_node_launch_command(path):
    first = path.read_text().splitlines()[0]
    assert first.startswith(f"# accelerate launch --config_file accelerate_configs/{path.name} "), first
    for flag in ("--machine_rank", "--main_process_ip", "--main_process_port"):
        assert flag in first, (flag, first)
    config = yaml.safe_load(path.read_text())
    assert config["num_machines"] >= 2
    # num_processes is the total over all machines; accelerate starts num_processes // num_machines per node
    assert config["num_processes"] % config["num_machines"] == 0
    assert config["num_processes"] >= config["num_machines"]
    assert config["machine_rank"] == 0 and config["rdzv_backend"] == "static"
    assert config["main_process_ip"] and config["main_process_port"]
    if config["distributed_type"] == "DEEPSPEED":
        # torchrun on every node: no hostfile, no pdsh/ssh from node 0
        assert config["deepspeed_config"]["deepspeed_multinode_launcher"] == "standard"
        assert "deepspeed_hostfile" not in config["deepspeed_config"]


def node_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("DIFFU_", "WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_", "ACCELERATE_"))}
    # Gloo picks its network interface from the hostname; where that does not resolve to a reachable
    # address (containers, sandboxes) the ranks cannot connect. Both "nodes" are on loopback here.
    if sys.platform.startswith("linux"):
        env["GLOO_SOCKET_IFNAME"] = "lo"
    env["OMP_NUM_THREADS"] = "1"  # two single-process nodes share this machine's cores
    return env


def tail(path: pathlib.Path, chars: int = 4000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else "<none>"


def launch_two_nodes(config: str, tmp_path: pathlib.Path):
    """Start node 0 and node 1 side by side; return their (stderr text, output_dir) once both exit 0."""
    port = free_port()
    env = node_env()
    nodes = []
    for rank in (0, 1):
        output_dir = tmp_path / f"node{rank}"
        command = accelerate_command(
            "--config_file", f"accelerate_configs/{config}.yaml",
            "--num_machines", "2", "--machine_rank", rank, "--main_process_ip", "127.0.0.1",
            "--main_process_port", port,
            "recipes/quickstart.py", "--output_dir", output_dir, "--max_steps", "2",
            "--per_device_train_batch_size", "8", "--logging_steps", "1", "--disable_tqdm", "true",
            "--save_strategy", "no", processes=2,
        )
        stdout, stderr = tmp_path / f"node{rank}.out", tmp_path / f"node{rank}.err"
        # log files, not pipes: a full pipe would stall a node; own session: stop() reaches its children
        with open(stdout, "w") as out, open(stderr, "w") as err:
            process = start_launch(command, processes=2, cwd=ROOT, env=env, stdout=out, stderr=err)
        nodes.append((process, stderr, output_dir))

    problem = wait_for_all([process for process, _, _ in nodes], LAUNCH_TIMEOUT_S)
    if problem is not None:
        pytest.fail(problem + "".join(f"\n--- node {rank} (exit {p.returncode}) stderr tail:\n{tail(e)}"
                                      for rank, (p, e, _) in enumerate(nodes)))
    return [(stderr.read_text(errors="replace"), output_dir) for _, stderr, output_dir in nodes]


# multi_node_zero2.yaml: the README's and docs/multi_node.md's two-node commands run it as written, with these
# checks (tests/project/test_readme_commands.py, two_nodes_as_one_world); a third launch here would add no path.
@pytest.mark.launch
@pytest.mark.parametrize("config", ["multi_node"])
def test_two_nodes_train_as_one_world(config, tmp_path):
    (main_err, main_dir), (other_err, other_dir) = launch_two_nodes(config, tmp_path)
    # ranks are global: the main node holds rank 0 of a 2-process world, node 1 holds rank 1
    assert "hf-grpo batch plan (world size 2)" in main_err, main_err[-4000:]
    assert "(8 per device x 2 devices)" in main_err
    assert "hf-grpo batch plan" not in other_err
    rows = [json.loads(line) for line in (main_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2]
    assert all(math.isfinite(row["loss"]) for row in rows), rows
    assert not (other_dir / "metrics.jsonl").exists()  # only global rank 0 writes
