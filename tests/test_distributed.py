"""Expert parallelism over mx.distributed: two processes on this machine (ring over 127.0.0.1)
give logits identical to one process of stock mlx-lm, each reading only its own experts."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

RUN = Path(__file__).with_name("distributed_run.py")
LAUNCH = shutil.which("mlx.launch")
pytestmark = pytest.mark.skipif(LAUNCH is None, reason="mlx.launch is not installed")


def launch(*args, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run([LAUNCH, "--backend", "ring", "-n", "2", sys.executable, *map(str, args)],
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("bits", [None, 4])
@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "gpt_oss"])
def test_two_hosts_match_one_stock_process_bit_for_bit(tiny_model, arch, bits):
    # 60% of a host's half of the experts: 30% of all expert bytes, so both evict
    out = launch(RUN, tiny_model(arch, bits=bits), "60%")
    assert out.returncode == 0, out.stderr[-3000:]
    hosts = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert sorted(h["host"] for h in hosts) == [0, 1]
    for h in hosts:
        assert h["equal"] and h["own_reads"] and h["evictions"] > 0
    assert hosts[0]["combined_loads"] == sum(h["loads"] for h in hosts)
