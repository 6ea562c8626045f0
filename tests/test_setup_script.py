"""scripts/setup's helpers, run on their own in bash: the build shows it is alive, and the build id
is hashed where sha256sum is missing (stock macOS has only shasum)."""

import re
import subprocess
from pathlib import Path

SETUP = Path(__file__).resolve().parents[1] / "scripts" / "setup"


def helpers() -> str:
    text = SETUP.read_text()
    match = re.search(r"# --- helpers .*?\n(.*?)# --- end of helpers ---", text, re.S)
    assert match, "scripts/setup lost its helpers block"
    return match.group(1)


def run_bash(script: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", helpers() + script], capture_output=True, text=True, timeout=60)


def test_a_long_command_prints_the_elapsed_time_while_it_runs_and_keeps_its_status():
    done = run_bash("CACTUS_EDGE_HEARTBEAT=1 with_heartbeat bash -c 'sleep 3.5; exit 3'; echo status=$?")
    beats = re.findall(r"still building \(0 min (\d+) s\)", done.stderr)
    assert len(beats) >= 2 and [int(b) for b in beats] == sorted(int(b) for b in beats), done.stderr
    assert "status=3" in done.stdout  # the command's own exit status, for set -e


def test_a_quick_command_prints_nothing():
    done = run_bash("with_heartbeat true; echo status=$?")
    assert done.stderr == "" and "status=0" in done.stdout


def test_the_build_id_hashes_with_shasum_where_sha256sum_is_missing(tmp_path):
    # A fake shasum made of shell builtins: it reads its input and names its arguments.
    (tmp_path / "shasum").write_text('#!/bin/sh\nwhile read -r line; do :; done\necho "shasum $* $line"\n')
    (tmp_path / "shasum").chmod(0o755)
    bash = subprocess.run(["bash", "-c", "command -v bash"], capture_output=True, text=True).stdout.strip()
    env = {"PATH": f"{tmp_path}"}  # no coreutils at all: sha256sum is missing
    done = subprocess.run(
        [bash, "-c", helpers() + "printf abc | sha256"], capture_output=True, text=True, env=env, timeout=60
    )
    assert done.stdout.split() == ["shasum", "-a", "256", "abc"], (done.stdout, done.stderr)
    # With sha256sum present, the digest is sha256's.
    digest = run_bash("printf abc | sha256").stdout.split()[0]
    assert digest == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
