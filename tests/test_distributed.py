"""Expert parallelism over mx.distributed: two processes on this machine (ring over 127.0.0.1)
give logits identical to one process of stock mlx-lm, each reading only its own experts."""

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

import mlx_moestream
from test_serve import free_port

RUN = Path(__file__).with_name("distributed_run.py")
LAUNCH = shutil.which("mlx.launch")
needs_launch = pytest.mark.skipif(LAUNCH is None, reason="mlx.launch is not installed")


def ring_hosts(tmp_path, script, *args, timeout=120, grace=5) -> list[subprocess.CompletedProcess]:
    """`python SCRIPT ARGS` on two hosts over the ring backend on this machine, started as
    `mlx.launch --backend ring -n 2` starts them (a hostfile, MLX_RANK) but without its
    launcher, which polls its hosts' pipes without pause (a core for as long as they run).
    Each host runs to its own end; once one has failed, the other has `grace` seconds to end
    by itself before it is killed (mlx.launch ends it at once)."""
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{free_port()}"] for _ in range(2)]))
    logs = [(tmp_path / f"host{rank}.out", tmp_path / f"host{rank}.err") for rank in range(2)]
    hosts = []
    for rank, (out, err) in enumerate(logs):  # files, not pipes: no host blocks on its output
        with open(out, "w") as stdout, open(err, "w") as stderr:
            hosts.append(subprocess.Popen(
                [sys.executable, str(script), *map(str, args)], stdout=stdout, stderr=stderr,
                env=os.environ | {"MLX_HOSTFILE": str(hostfile), "MLX_RANK": str(rank)}))
    deadline = time.monotonic() + timeout
    try:
        while any(host.poll() is None for host in hosts) and time.monotonic() < deadline:
            if any(host.returncode for host in hosts):
                deadline = min(deadline, time.monotonic() + grace)
            time.sleep(0.05)
    finally:  # none left running after a timeout or a failure
        for host in hosts:
            host.kill()
            host.wait()
    return [subprocess.CompletedProcess(host.args, host.returncode, out.read_text(),
                                        err.read_text())
            for host, (out, err) in zip(hosts, logs)]


def host_lines(hosts: list[subprocess.CompletedProcess]) -> list[str]:
    """The lines the hosts printed that start with "host ", in host order."""
    return [line for host in hosts for line in host.stdout.splitlines()
            if line.startswith("host ")]


ARCHS, BITS = ["qwen3_moe", "mixtral", "gpt_oss"], [None, 4]


@pytest.fixture(scope="session")
def run_hosts(tiny_model, tmp_path_factory):
    """`distributed_run.py` on two hosts at 60% of each host's experts, every architecture
    and quantization in one launch (a launch costs two processes' start, most of its time):
    {(arch, bits): (each host's findings in host order, the folder it wrote to)}."""
    models = {(arch, bits): tiny_model(arch, bits=bits) for arch in ARCHS for bits in BITS}
    folder = tmp_path_factory.mktemp("hosts")
    done = ring_hosts(folder, RUN, "60%", folder, *models.values(), timeout=300)
    assert [host.returncode for host in done] == [0, 0], [host.stderr[-3000:] for host in done]
    runs = {}
    for i, key in enumerate(models):
        hosts = [json.loads(f.read_text()) for f in sorted((folder / str(i)).glob("host*.json"))]
        found = [h["host"] for h in hosts]
        assert found == [0, 1], f"{key}: findings of hosts {found} only"  # each ran to its end
        runs[key] = hosts, folder / str(i)
    return runs


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("arch", ARCHS)
def test_two_hosts_match_one_stock_process_bit_for_bit(run_hosts, arch, bits):
    # 60% of a host's half of the experts: 30% of all expert bytes, so both evict
    hosts, _ = run_hosts[arch, bits]
    for h in hosts:
        assert h["equal"] and h["own_reads"] and h["evictions"] > 0
        # its routed ids, then the exchange; the input check's two at each call's first layer
        assert h["syncs"] == 2 * h["layer_calls"] + 2 * h["calls"]
    assert hosts[0]["combined_loads"] == sum(h["loads"] for h in hosts)


def test_hosts_sample_the_same_tokens(run_hosts):
    """Each host computes its experts for the token it sampled: hosts that sampled apart sum
    outputs of different tokens. Loading seeds every host alike."""
    for hosts, _ in run_hosts.values():
        assert hosts[0]["sampled"] == hosts[1]["sampled"]


def test_a_host_refuses_to_record_a_profile_or_a_trace(run_hosts):
    """A host sees its own experts only, numbered from 0: its profile or trace would be
    another model's under this one's fingerprint."""
    hosts, folder = run_hosts["qwen3_moe", None]
    for h in hosts:
        assert "cannot record a profile on a distributed model" in h["profile_refused"]
        assert "cannot record a trace on a distributed model" in h["trace_refused"]
    assert not (folder / "p.json").exists()


@pytest.mark.parametrize("step", ["decode", "stats", "line"])
@pytest.mark.parametrize("mode, message", [
    ("hang", "no answer from the other hosts for 3 s"),
    ("exit", "connection to a peer was lost"),
])
def test_a_lost_host_ends_the_others_with_a_clear_error(tiny_model, tmp_path, mode, message,
                                                       step):
    start = time.monotonic()
    host0, _ = ring_hosts(tmp_path, Path(__file__).with_name("distributed_lost_host.py"),
                          tiny_model("qwen3_moe"), mode, step, grace=1)  # host 1 may hang
    assert host0.returncode == 1 and message in host0.stderr, host0.stderr[-3000:]
    assert time.monotonic() - start < 60


def test_the_error_of_an_exchange_with_no_answer_starts_a_line_of_its_own():
    """Printed from the watchdog's thread while host 0 streams an answer to the terminal."""
    code = ("import sys, time\n"
            "from mlx_moestream.mlx.hosts import Watchdog\n"
            "watchdog = Watchdog(0.5)\n"
            "print('Ciao, come', end='', flush=True)\n"
            "with watchdog:\n"
            "    time.sleep(30)\n")
    out = subprocess.run([sys.executable, "-c", code], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, timeout=60)
    assert out.returncode == 1
    assert out.stdout == ("Ciao, come\nError: no answer from the other hosts for 0.5 s: a host "
                          "has stopped or cannot be reached\n")


def load_on_hosts(tmp_path, path0, budget0, path1, budget1) -> list[str]:
    """Each host's line from `distributed_load.py`, in host order."""
    return host_lines(ring_hosts(tmp_path, Path(__file__).with_name("distributed_load.py"),
                                 path0, budget0, path1, budget1))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="posix_fadvise, mincore")
def test_a_distributed_load_leaves_the_page_cache(tiny_model, tmp_path):
    """Hosts compare a fingerprint of their checkpoints, read from the files (every tensor of
    at most 4 MiB whole): it was read after the load dropped the files' pages, and stayed."""
    from test_memory import _cached_bytes, _dropped

    path = tiny_model("qwen3_moe")
    shard = path / "model.safetensors"
    _dropped(shard)
    assert load_on_hosts(tmp_path, path, "50%", path, "50%") == ["host 0: loaded", "host 1: loaded"]
    assert _cached_bytes(shard) <= shard.stat().st_size // 20


@pytest.mark.parametrize("change", ["weights", "config.json", "tokenizer_config.json"])
def test_hosts_with_different_checkpoints_refuse_to_run(tiny_model, tmp_path, change):
    """Other weights, another config (the same layout) or another chat template: the exchanged
    outputs would be another model's, or of other tokens. Every host refuses."""
    path = tiny_model("qwen3_moe")
    if change == "weights":
        other = tiny_model("qwen3_moe", seed=1)
    else:
        other = shutil.copytree(path, tmp_path / "other")
        settings = json.loads((other / change).read_text())
        if change == "config.json":
            settings["rope_theta"] = 1234.0
        else:
            settings["chat_template"] = "{{ messages[0]['content'] }}"
        (other / change).write_text(json.dumps(settings))
    lines = load_on_hosts(tmp_path, path, "60%", other, "60%")
    assert len(lines) == 2
    assert all("host 1 has another checkpoint than host 0" in line for line in lines), lines


def test_a_read_error_on_one_host_ends_every_host_in_one_line(tiny_model, tmp_path):
    """Raised on its host alone, it would skip the exchange the others wait in, and pair each
    later one with another layer's: wrong outputs on every host."""
    host0, host1 = ring_hosts(tmp_path, Path(__file__).with_name("distributed_lost_host.py"),
                              tiny_model("qwen3_moe"), "read-error", "decode")
    error, = host1.stderr.splitlines()[1:]  # on a line of its own, after any streamed text
    assert host1.returncode == 1 and error.startswith("Error: host 1: injected read error")
    assert host0.returncode == 1
    assert "Error: [ring] connection to a peer was lost" in host0.stderr


@pytest.mark.parametrize("mode, after", [("tokens", 0), ("length", 0), ("seed", None)])
def test_hosts_fed_other_tokens_refuse_the_call_on_every_host(tiny_model, tmp_path, mode,
                                                              after):
    """Each host's expert outputs were summed with those of another token's: wrong outputs on
    every host (of other lengths: outputs of other shapes). Sampling seeded apart feeds each
    host its own token from the next call on."""
    hosts = ring_hosts(tmp_path, Path(__file__).with_name("distributed_inputs.py"),
                       tiny_model("qwen3_moe"), mode)
    lines = host_lines(hosts)
    assert len(lines) == 2, hosts[0].stderr + hosts[1].stderr
    counts = set()
    for host, line in enumerate(lines):
        assert line.startswith(f"host {host}: after "), lines
        assert line.endswith("Error: host 1 was given other input tokens than host 0: every host "
                             "must make the same calls with the same inputs (and sample alike: "
                             "do not seed hosts apart)"), lines
        counts.add(int(line.split()[3]))
    assert len(counts) == 1 and (after is None or counts == {after}), lines  # at the same call


def test_a_load_failing_on_one_host_fails_every_host_in_one_line(tiny_model, tmp_path):
    path = tiny_model("qwen3_moe")
    lines = load_on_hosts(tmp_path, path, "60%", path, "1KiB")
    assert "could not load the model" in lines[0] and "host 1" in lines[0], lines
    assert "below the minimum" in lines[1], lines


def test_a_distributed_load_refuses_a_timeout_that_is_not_a_positive_number():
    for bad in (0, -1, None, float("inf")):
        with pytest.raises(ValueError, match="timeout_seconds must be a positive number"):
            mlx_moestream.load(None, distributed=True, timeout_seconds=bad)


@needs_launch
def test_chat_on_two_hosts_answers_once_with_every_host_s_statistics(tiny_model):
    out = subprocess.run([LAUNCH, "--backend", "ring", "-n", "2", "--", sys.executable, "-m",
                          "mlx_moestream.cli", "chat", "--model", str(tiny_model("qwen3_moe")),
                          "--distributed", "--budget", "60%", "--prompt", "Ciao",
                          "--max-tokens", "4"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("generated at") == 1 and "all 2 hosts: hit rate" in out.stdout
    assert "host 0 experts, session so far: hit rate" in out.stdout  # not the whole model's


@needs_launch
def test_chat_whose_load_fails_on_one_host_ends_every_host_in_one_line(tiny_model):
    budget = '$([ "$MLX_RANK" = 1 ] && echo 1KiB || echo 60%)'  # too small on host 1 alone
    chat = (f"{sys.executable} -m mlx_moestream.cli chat --model {tiny_model('qwen3_moe')} "
            f"--distributed --budget {budget} --prompt Ciao --max-tokens 4")
    out = subprocess.run([LAUNCH, "--backend", "ring", "-n", "2", "--", "sh", "-c", chat],
                         capture_output=True, text=True, timeout=300)
    errors = [line for line in out.stderr.splitlines() if line.startswith("Error:")]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    assert len(errors) == 2 and any("host 1 could not load the model" in e for e in errors)
    assert any("below the minimum" in e for e in errors), errors


def test_host_0_refuses_a_line_that_is_not_utf8_and_reads_another(monkeypatch, capsys):
    """Encoding it for the others failed and ended every host's chat; a single host's chat
    says so and goes on."""
    from contextlib import nullcontext

    from mlx_moestream.cli import user_input

    lines = iter(["caf\udce9", "Ciao"])  # a Latin-1 byte, as Python decodes stdin
    monkeypatch.setattr("builtins.input", lambda prompt: next(lines))
    assert user_input.read_on_host_0(nullcontext(), ">>> ") == "Ciao"
    assert "the message is not UTF-8 text" in capsys.readouterr().err


def test_inspect_gives_the_minimum_budget_per_host(tiny_model):
    out = subprocess.run([sys.executable, "-m", "mlx_moestream.cli", "inspect", "--model",
                          str(tiny_model("qwen3_moe")), "--hosts", "2", "--json"],
                         capture_output=True, text=True, timeout=300)
    info = json.loads(out.stdout)
    assert info["hosts"] == 2
    assert info["min_budget_bytes_per_host"] == info["top_k"] * info["expert_bytes"]


def test_inspect_prints_every_minimum_in_bytes(tiny_model):
    out = subprocess.run([sys.executable, "-m", "mlx_moestream.cli", "inspect", "--model",
                          str(tiny_model("qwen3_moe")), "--hosts", "2"],
                         capture_output=True, text=True, timeout=300)
    assert re.search(r"minimum per host: [\d.]+ KiB \(\d+ bytes\)", out.stdout), out.stdout
    assert re.search(r"with --per-layer: [\d.]+ KiB \(\d+ bytes\)", out.stdout), out.stdout


def test_a_host_holding_fewer_experts_of_a_layer_than_top_k_needs_only_those(tiny_model):
    """8 experts over 3 hosts, top-3: host 0 holds 2 of each layer, and a call routes to at
    most those 2 of its own."""
    from mlx_moestream.mlx import load_lazy

    plan = load_lazy(tiny_model("qwen3_moe", num_experts_per_tok=3))[-1]
    share = plan.host_share(0, 3)
    assert share.layers[0].num_experts == 2
    assert share.min_budget_bytes == 2 * share.layers[0].slot_bytes  # one pool for both layers


def test_every_token_counts_on_a_host_that_owns_none_of_a_call(run_hosts):
    """Top-2 of 8 experts over 2 hosts: some layer-0 calls route to the other host alone; the
    tokens still count on both hosts (the policies decay by them)."""
    hosts, _ = run_hosts["mixtral", None]
    assert [h["tokens"] for h in hosts] == [64 + 12] * 2
