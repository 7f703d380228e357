"""megamoe_run as the package installs it (megamoe/bin): --help, refused numbers, and the flags applied on
the CPU reference path."""

import pathlib
import subprocess

import pytest
import torch

import megamoe

TOOL = pathlib.Path(megamoe.__file__).resolve().parent / "bin" / "megamoe_run"


def run(*args):
    if not TOOL.is_file():
        pytest.skip(f"{TOOL} is not installed (the package was not built)")
    return subprocess.run([str(TOOL), *args], capture_output=True, text=True, timeout=300)


def test_help_says_what_each_flag_does_and_exits_0():
    result = run("--help")
    assert result.returncode == 0, result.stderr
    for flag in ("--tokens T", "--ranks R", "--iters N", "--cpu", "--help"):
        assert flag in result.stdout


@pytest.mark.parametrize("args, message", [
    (("--tokens", "abc"), "--tokens needs a whole number from 1 to 1048576, got 'abc'"),
    (("--ranks", "0"), "--ranks needs a whole number from 1 to 1024, got '0'"),
    (("--iters", "-2"), "--iters needs a whole number from 1 to 1000000, got '-2'"),
    (("--ranks",), "--ranks needs a value"),
    (("--fast",), "unknown argument '--fast'"),
])
def test_bad_command_lines_are_refused_with_a_message(args, message):
    result = run(*args)
    assert result.returncode == 2
    assert message in result.stderr and "--help" in result.stderr


def test_flags_apply_to_the_cpu_reference():
    result = run("--cpu", "--ranks", "4", "--tokens", "8", "--iters", "2")
    assert result.returncode == 0, result.stderr
    assert "E=16 K=2 R=4 max_tokens_per_rank=8" in result.stdout and "2 run(s)" in result.stdout
    assert "32 tokens x top-2 on 4 rank(s)" in result.stdout
    assert sum(line.startswith("rank ") for line in result.stdout.splitlines()) == 4


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without a GPU")
def test_without_a_gpu_it_says_why_and_runs_the_reference():
    result = run("--ranks", "2", "--tokens", "4")
    assert result.returncode == 0, result.stderr
    assert "no GPU found: " in result.stdout and "running the CPU reference instead" in result.stdout
    assert "insufficient" not in result.stdout  # the runtime's misleading text for "no driver at all"
    assert "R=2 max_tokens_per_rank=4" in result.stdout
