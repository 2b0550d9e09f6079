"""Launches over several machines: SLURM's environment read into a c10d rendezvous, and two launchers of two
workers each on this machine ("2 nodes x 2 GPUs") training the same model as one process."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from conftest import REPO, failure_report, free_port, worker_env

from meshtron.cluster import Nodes, command_line_nodes, expand_hostlist, slurm_nodes
from meshtron.errors import ConfigError

LOSS_RTOL = 1e-5


@pytest.mark.parametrize(
    "hostlist, hosts",
    [
        ("gpu01", ["gpu01"]),
        ("gpu[01-03,07],login1", ["gpu01", "gpu02", "gpu03", "gpu07", "login1"]),
        ("r[1-2]n[08-09]", ["r1n08", "r1n09", "r2n08", "r2n09"]),
        ("a[9-10]-ib,b", ["a9-ib", "a10-ib", "b"]),
    ],
)
def test_slurm_host_lists_expand(hostlist, hosts):
    assert expand_hostlist(hostlist) == hosts


def test_a_slurm_job_of_several_nodes_gives_the_rendezvous():
    env = {
        "SLURM_JOB_ID": "123457",
        "SLURM_NNODES": "4",
        "SLURM_NODEID": "2",
        "SLURM_JOB_NODELIST": "node[007-010]",
        "SLURM_GPUS_ON_NODE": "8",
    }
    nodes = slurm_nodes(env)
    assert nodes == Nodes(4, 2, "node007:29857", "slurm-123457", 8)
    assert nodes.launcher_args(8) == [
        "--nnodes=4",
        "--node-rank=2",
        "--nproc-per-node=8",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=node007:29857",
        "--rdzv-id=slurm-123457",
    ]
    assert slurm_nodes(env, port=31000).endpoint == "node007:31000"
    assert slurm_nodes({**env, "SLURM_NNODES": "1"}) is None  # one node: the usual one-machine launch
    assert slurm_nodes({"SLURM_NNODES": "4"}) is None  # not in a job
    with pytest.raises(ConfigError, match="SLURM_NODEID is not set: start meshtron with srun"):
        slurm_nodes({k: v for k, v in env.items() if k != "SLURM_NODEID"})
    with pytest.raises(ConfigError, match="not a SLURM host list"):
        slurm_nodes({**env, "SLURM_JOB_NODELIST": "node[a-c]"})


def test_command_line_nodes_need_an_endpoint():
    assert command_line_nodes(None, None, None, None) is None
    assert command_line_nodes(2, 1, "10.0.0.1:29500", "job7") == Nodes(2, 1, "10.0.0.1:29500", "job7")
    with pytest.raises(ConfigError, match="needs --rdzv-endpoint HOST:PORT"):
        command_line_nodes(2, None, None, None)
    with pytest.raises(ConfigError, match="add --nnodes N"):
        command_line_nodes(None, None, "h:1", None)


def overrides(out) -> list[str]:
    return [
        "--model.preset=llama-tiny",
        "--data.max_documents=40",
        "--data.seq_len=32",
        "--train.steps=6",
        "--train.global_batch_size=8",
        "--run.progress=false",
        f"--run.output_dir={out}",
    ]


def losses(run) -> list[float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [row["loss"] for row in rows if "loss" in row]


@pytest.mark.slow
def test_two_launchers_from_a_fake_slurm_environment_train_as_one_process(tmp_path, cache_dir):
    """Two `meshtron train --nproc 2` launchers, each told by a fake SLURM environment that it is node 0 or 1 of
    job 4242 (node list "localhost"), meet over c10d and train FSDP over 4 ranks: the losses of one process. Node 0
    starts its workers as fresh interpreters (`--rank-start fresh`, as torchrun), node 1 forks them (the default)."""
    from meshtron.config import load_config
    from meshtron.distributed.runtime import Runtime
    from meshtron.train.trainer import train

    port, out = free_port(), tmp_path / "two-nodes"
    cache = [f"--data.cache_dir={cache_dir}"]
    launchers = [
        subprocess.Popen(
            [sys.executable, "-m", "meshtron", "train", *overrides(out), *cache, "--master-port", str(port)]
            + (["--rank-start", "fresh"] if node == 0 else []),
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=worker_env(
                SLURM_JOB_ID="4242",
                SLURM_NNODES="2",
                SLURM_NODEID=str(node),
                SLURM_JOB_NODELIST="localhost",
                SLURM_GPUS_ON_NODE="2",
            ),
        )
        for node in (0, 1)
    ]
    results = [launcher.communicate(timeout=400) for launcher in launchers]
    for launcher, (stdout, stderr) in zip(launchers, results):
        assert launcher.returncode == 0, failure_report(
            subprocess.CompletedProcess([], launcher.returncode, stdout, stderr)
        )
    log = "".join(stdout for stdout, _ in results)
    assert "layout: dp_shard=4 |" in log, log[-2000:]  # one world of 4 ranks over the two launchers

    cfg = load_config(
        None, [item[2:] for item in overrides(tmp_path / "one")] + [f"data.cache_dir={cache_dir}"], env={}
    )
    train(cfg, Runtime(rank=0, local_rank=0, world_size=1, device=torch.device("cpu")))
    got, want = losses(out), losses(tmp_path / "one")
    assert len(got) == len(want) == 6
    for step, (a, b) in enumerate(zip(got, want), 1):
        assert abs(a - b) <= LOSS_RTOL * abs(b), f"step {step}: {a} (2 nodes x 2) vs {b} (1 process)"


def test_the_sbatch_example_is_valid_bash_that_launches_one_meshtron_per_node():
    script = REPO / "examples" / "slurm" / "train.sbatch"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    text = script.read_text()
    assert "#SBATCH --ntasks-per-node=1" in text and "srun --kill-on-bad-exit=1 meshtron train" in text
    assert "#SBATCH --signal=USR1@300" in text and 'scontrol requeue "$SLURM_JOB_ID"' in text
