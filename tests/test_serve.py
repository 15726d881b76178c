"""`mlx-moestream serve` against stock `mlx_lm.server` on the embedded model: one process of
each, started once, spoken to by the real `openai` client; `/metrics` read by prometheus_client's
parser; `top --once` against the running server."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from mlx_moestream.hub import EMBEDDED_MODEL

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
PROMPTS = ["Ciao, come stai?", "Tell me about the sea.", "def main():", "Dove si trova Roma?"]


class Server:
    """A server process; its address once it answers `/v1/models`."""

    def __init__(self, args: list[str], log: Path, port: int | None = None):
        self.log = log
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL,
                                        stderr=open(log, "w"), env=ENV, cwd=log.parent)
        self.port = port or self._announced_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._wait()
        self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0,
                                    timeout=120)

    def _announced_port(self) -> int:
        for _ in range(600):
            found = re.search(r"at http://127\.0\.0\.1:(\d+)/v1", self.log.read_text())
            if found:
                return int(found.group(1))
            assert self.process.poll() is None, self.log.read_text()
            time.sleep(0.1)
        raise AssertionError(f"no address announced: {self.log.read_text()}")

    def _wait(self) -> None:
        for _ in range(600):
            try:
                urllib.request.urlopen(f"{self.url}/v1/models", timeout=5).read()
                return
            except (urllib.error.URLError, ConnectionError):
                assert self.process.poll() is None, self.log.read_text()
                time.sleep(0.1)
        raise AssertionError(f"{self.url} never answered")

    def stop(self) -> int:
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=60)


def serve_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "mlx_moestream", "serve", "--port", "0", *args]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def stock(tmp_path_factory):
    port = free_port()
    server = Server([sys.executable, "-m", "mlx_lm", "server", "--model", str(EMBEDDED_MODEL),
                     "--port", str(port)], tmp_path_factory.mktemp("stock") / "log", port)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def ours(tmp_path_factory):
    server = Server(serve_command("--budget", "30%"), tmp_path_factory.mktemp("ours") / "log")
    yield server
    server.stop()


def chat(server: Server, prompt: str, **kwargs) -> str:
    reply = server.client.chat.completions.create(
        model="default_model", messages=[{"role": "user", "content": prompt}],
        max_tokens=24, temperature=0, **kwargs)
    return reply.choices[0].message.content


def streamed(server: Server, prompt: str) -> str:
    chunks = server.client.chat.completions.create(
        model="default_model", messages=[{"role": "user", "content": prompt}],
        max_tokens=24, temperature=0, stream=True)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def post(server: Server, body: bytes, path: str = "/v1/chat/completions") -> tuple[int, str]:
    request = urllib.request.Request(f"{server.url}{path}", data=body,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def metrics(server: Server) -> dict:
    text = urllib.request.urlopen(f"{server.url}/metrics").read().decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


def test_chat_matches_stock(stock, ours):
    for prompt in PROMPTS:
        assert chat(ours, prompt) == chat(stock, prompt)


def test_streamed_chat_matches_stock(stock, ours):
    for prompt in PROMPTS[:2]:
        assert streamed(ours, prompt) == streamed(stock, prompt)


def test_concurrent_chats_match_stock(stock, ours):
    def together(server):
        with ThreadPoolExecutor(4) as pool:
            return list(pool.map(lambda p: chat(server, p), PROMPTS))

    assert together(ours) == together(stock)


def test_text_completion_with_stop_and_logprobs_matches_stock(stock, ours):
    def complete(server):
        reply = server.client.completions.create(model="default_model", prompt="Roma e' ",
                                                 max_tokens=16, temperature=0, stop=["."],
                                                 logprobs=True)
        return reply.choices[0].text, reply.model_dump()["choices"][0]["logprobs"]["content"]

    text, logprobs = complete(ours)
    assert text and len(logprobs) > 0
    assert (text, logprobs) == complete(stock)


def test_models_lists_the_served_model(ours):
    assert [m.id for m in ours.client.models.list().data] == ["embedded", "default_model"]


def test_another_model_is_not_found(ours):
    with pytest.raises(openai.NotFoundError) as refused:
        ours.client.chat.completions.create(model="mlx-community/other", max_tokens=4,
                                            messages=[{"role": "user", "content": "hi"}])
    assert refused.value.response.json() == {
        "error": "model 'mlx-community/other' is not served here: this server serves "
                 "'embedded' (or name it 'default_model')"}


def test_metrics_count_the_cache_per_layer(ours):
    chat(ours, PROMPTS[0])
    families = metrics(ours)
    hits = {s.labels["layer"]: s.value for s in families["moestream_hits"].samples}
    misses = {s.labels["layer"]: s.value for s in families["moestream_misses"].samples}
    assert sorted(hits) == sorted(misses) == ["0", "1", "2", "3"]
    assert sum(hits.values()) + sum(misses.values()) > 0
    demand = sum(s.value for s in families["moestream_demand_loads"].samples)
    assert 0 < demand <= sum(s.value for s in families["moestream_loads"].samples)
    assert families["moestream_bytes_read"].samples[0].name == "moestream_bytes_read_total"
    budget = families["moestream_budget_bytes"].samples[0].value
    assert 0 < families["moestream_resident_bytes"].samples[0].value <= budget
    reads = {s.name: s.value for s in families["moestream_expert_read_seconds"].samples
             if not s.labels}
    assert reads["moestream_expert_read_seconds_count"] > 0
    assert "moestream_stall_seconds_per_token" in families
    requests = families["moestream_requests"].samples
    assert sum(s.value for s in requests if s.name == "moestream_requests_total") >= 1


def test_stats_endpoint_lists_resident_experts(ours):
    chat(ours, PROMPTS[1])
    stats = json.loads(urllib.request.urlopen(f"{ours.url}/v1/moestream/stats").read())
    resident = sum(len(layer["resident_experts"]) for layer in stats["layers"])
    assert resident > 0
    assert stats["policy"] == "cyclic"


@pytest.mark.parametrize("body, error", [
    (b'{"messages": [', "Invalid JSON"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": -3}', "max_tokens"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10000000}',
     "max_tokens must be at most 2048"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}', "temperature"),
])
def test_bad_request_is_refused_and_the_next_is_answered(stock, ours, body, error):
    status, text = post(ours, body)
    assert 400 <= status < 500
    assert error in json.loads(text)["error"] and "\n" not in text
    assert chat(ours, PROMPTS[0]) == chat(stock, PROMPTS[0])


def test_prompt_longer_than_the_context_is_refused(stock, ours):
    body = json.dumps({"messages": [{"role": "user", "content": "ciao " * 3000}],
                       "max_tokens": 4}).encode()
    status, text = post(ours, body)
    assert 400 <= status < 500
    assert "the model's context holds 2048" in json.loads(text)["error"]
    assert chat(ours, PROMPTS[2]) == chat(stock, PROMPTS[2])


def test_disconnect_mid_stream_stops_generation(stock, ours):
    chunks = ours.client.chat.completions.create(
        model="default_model", messages=[{"role": "user", "content": PROMPTS[3]}],
        max_tokens=2000, temperature=0, stream=True,
        logit_bias={"0": -100, "2": -100})  # no end of text: it would go on to max_tokens
    next(iter(chunks))
    chunks.close()
    time.sleep(1.0)  # the server sees the closed connection at its next writes
    before = metrics(ours)["moestream_tokens"].samples[0].value
    time.sleep(2.0)  # a generation that went on would route ~100 tokens a second meanwhile
    after = metrics(ours)["moestream_tokens"].samples[0].value
    assert after - before < 5
    assert chat(ours, PROMPTS[1]) == chat(stock, PROMPTS[1])


def test_top_once_shows_the_cache(ours):
    chat(ours, PROMPTS[0])
    shown = subprocess.run([sys.executable, "-m", "mlx_moestream", "top", ours.url, "--once"],
                           capture_output=True, text=True, env={**ENV, "COLUMNS": "120"},
                           timeout=60)
    assert shown.returncode == 0, shown.stderr
    assert "hit rate" in shown.stdout and "layer" in shown.stdout


def test_a_model_that_cannot_load_is_a_one_line_error(tmp_path):
    done = subprocess.run(serve_command("--model", str(tmp_path / "missing")), env=ENV,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert done.stderr.strip() == f"Error: no such directory: {tmp_path / 'missing'} (a Hugging " \
                                  "Face repo id is NAME or OWNER/NAME)"


def test_save_every_without_a_profile_to_save_is_refused():
    done = subprocess.run(serve_command("--save-every", "5"), env=ENV, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2
    assert "Error: --save-every needs --profile save NAME" in done.stderr


def test_sigterm_saves_the_profile(tmp_path):
    server = Server(serve_command("--budget", "30%", "--profile", "save", "server-run.json"),
                    tmp_path / "log")
    chat(server, PROMPTS[0])
    assert server.stop() == 128 + signal.SIGTERM
    saved = json.loads((tmp_path / "server-run.json").read_text())
    assert saved["tokens"] > 0
    assert "profile server-run.json saved" in server.log.read_text()
    assert "Traceback" not in server.log.read_text()


def test_a_loaded_profile_prewarms_and_answers_as_stock(tmp_path, stock):
    server = Server(serve_command("--budget", "30%", "--profile", "load", "italian-chat",
                                  "--pin-share", "0.5"), tmp_path / "log")
    try:
        stats = json.loads(urllib.request.urlopen(f"{server.url}/v1/moestream/stats").read())
        assert stats["prewarm"]["experts"] > 0
        pinned = [len(layer["pinned_experts"]) for layer in stats["layers"]]
        assert pinned == [layer["pinned"] for layer in stats["layers"]] and sum(pinned) > 0
        assert chat(server, PROMPTS[0]) == chat(stock, PROMPTS[0])
    finally:
        server.stop()


def test_sigterm_lets_the_request_in_flight_finish(tmp_path):
    server = Server(serve_command("--budget", "30%"), tmp_path / "log")
    chunks = server.client.chat.completions.create(
        model="default_model", messages=[{"role": "user", "content": PROMPTS[3]}],
        max_tokens=120, temperature=0, stream=True, logit_bias={"0": -100, "2": -100})
    stream = iter(chunks)
    next(stream)
    server.process.send_signal(signal.SIGTERM)
    reasons = [c.choices[0].finish_reason for c in stream if c.choices]
    assert reasons[-1] == "length"
    assert server.process.wait(timeout=60) == 128 + signal.SIGTERM
    assert "Traceback" not in server.log.read_text()


def test_profile_is_saved_while_serving_every_save_every_minutes(tmp_path):
    server = Server(serve_command("--budget", "30%", "--profile", "save", "periodic.json",
                                  "--save-every", "0.01"), tmp_path / "log")
    try:
        chat(server, PROMPTS[0])
        saved = tmp_path / "periodic.json"
        for _ in range(100):
            if saved.exists():
                break
            time.sleep(0.1)
        assert json.loads(saved.read_text())["tokens"] > 0
    finally:
        server.stop()


def test_a_chat_template_given_answers_as_stock_given_it(tmp_path, stock):
    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    port = free_port()
    stock_templated = Server([sys.executable, "-m", "mlx_lm", "server", "--model",
                              str(EMBEDDED_MODEL), "--port", str(port), "--chat-template",
                              template], tmp_path / "stock", port)
    ours_templated = Server(serve_command("--budget", "30%", "--chat-template", template),
                            tmp_path / "ours")
    try:
        answer = chat(ours_templated, PROMPTS[0])
        assert answer == chat(stock_templated, PROMPTS[0])
        assert answer != chat(stock, PROMPTS[0])  # the template changed the prompt
    finally:
        stock_templated.stop()
        ours_templated.stop()
