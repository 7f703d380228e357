"""The examples run as a user runs them (a subprocess each, torchrun for the distributed one): on the CPU
with --cpu-reference, on the GPU as they are (the torchrun example on every GPU of the machine, or on one
GPU with groups of one when there are fewer than two)."""

import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch
from gpu_support import why_no_gpu

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"
SMALL = ["--hidden", "128", "--intermediate", "128", "--steps", "4"]


def run(args, timeout=180):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    result = subprocess.run([sys.executable, *args], cwd=EXAMPLES.parent, env=env, capture_output=True, text=True,
                            timeout=timeout)
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"exit status {result.returncode}:\n{output[-4000:]}"
    return result.stdout


def losses(stdout):
    found = [float(v) for v in re.findall(r"^step \d+: loss ([0-9.]+)", stdout, re.M)]
    assert found, f"no loss printed:\n{stdout}"
    return found


def torchrun(nproc, *args):
    return ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            str(EXAMPLES / "torchrun_expert_parallel.py"), *args]




needs_gpu = pytest.mark.skipif(bool(why_no_gpu()), reason=why_no_gpu() or "ok")


def test_moe_block_on_the_cpu_reference():
    out = run([str(EXAMPLES / "moe_block.py"), "--cpu-reference", *SMALL, "--shared-intermediate", "128",
               "--batch", "2", "--seq", "32"])
    found = losses(out)
    assert len(found) == 4 and found[-1] < found[0]


@pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                    reason="torch.distributed with gloo is not available")
def test_torchrun_example_two_nodes_of_two_on_the_cpu_reference():
    # 4 processes as 2 "nodes" of 2: expert-parallel groups of 2, experts replicated over 2 data-parallel ranks.
    out = run(torchrun(4, "--cpu-reference", "--ep-size", "2", *SMALL, "--tokens", "32"))
    assert "expert-parallel groups of 2 (one per node), 2 data-parallel replicas" in out
    assert "replicas in sync" in out
    found = losses(out)
    assert len(found) == 4 and found[-1] < found[0]


@needs_gpu
def test_moe_block_on_the_gpu():
    found = losses(run([str(EXAMPLES / "moe_block.py"), "--steps", "5"]))
    assert len(found) == 5 and found[-1] < found[0]


@needs_gpu
def test_torchrun_example_on_the_gpus():
    gpus = torch.cuda.device_count()
    nproc = max(n for n in (1, 2, 4, 8) if n <= gpus)  # 16 experts split evenly; one GPU: a group of one
    out = run(torchrun(nproc, "--steps", "5"))
    assert f"{nproc} ranks: expert-parallel groups of {nproc}" in out
    assert "replicas in sync" in out
    found = losses(out)
    assert len(found) == 5 and found[-1] < found[0]
