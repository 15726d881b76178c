"""The CLI as a user runs it: a real process."""

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from mlx_moestream.budget import format_bytes

ROOT = Path(__file__).resolve().parents[1]

CLI = [sys.executable, "-m", "mlx_moestream.cli"]


def run(*args, env=None):
    return subprocess.run([*CLI, *map(str, args)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})


def python_output(code: str) -> str:
    """What `python -c code` prints, once it has ended well."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_chat_with_prompt_prints_text_and_statistics(tiny_model):
    out = run("chat", "--model", tiny_model("qwen3_moe"), "--prompt", "Hello there",
              "--max-tokens", 16, "--budget", "25%")
    assert out.returncode == 0, out.stderr
    text, _, table = out.stdout.partition("[")
    assert text.strip()
    assert "16 generated" in table
    assert "hit rate" in table and "evictions" in table


def test_inspect_prints_the_minimum_budget(tiny_model):
    out = run("inspect", "--model", tiny_model("qwen3_moe"))
    assert out.returncode == 0, out.stderr
    assert "minimum budget: 48.0 KiB (49152 bytes)" in out.stdout


def test_inspect_of_layers_quantized_apart_shows_the_largest_and_smallest_expert(tmp_path,
                                                                                  monkeypatch):
    """It showed layer 0's size as every expert's."""
    from mlx_moestream import testing
    from mlx_moestream.testing import make_tiny_moe

    quantize = testing.quantize_model

    def layer_0_at_8_bits(model, config, group_size, bits):  # the others' experts at 2
        def bits_of(path, module):
            if "switch_mlp" not in path:
                return True
            return {"group_size": 32, "bits": 8 if ".layers.0." in path else 2}

        return quantize(model, config, 32, 4, quant_predicate=bits_of)

    monkeypatch.setattr(testing, "quantize_model", layer_0_at_8_bits)
    path = make_tiny_moe(tmp_path / "mixed", "qwen3_moe", bits=4)
    out = run("inspect", "--model", path)
    assert out.returncode == 0, out.stderr
    assert "largest expert: 7.5 KiB (7680 bytes)" in out.stdout
    assert "smallest expert: 3.0 KiB (3072 bytes)" in out.stdout


def test_inspect_prints_the_minimum_of_a_per_layer_split_and_it_loads(tiny_model):
    path = tiny_model("qwen3_moe")
    out = run("inspect", "--model", path, "--json")
    need = json.loads(out.stdout)["min_budget_bytes_per_layer"]
    assert need == 2 * json.loads(out.stdout)["min_budget_bytes"]  # 2 layers, each its top-k
    out = run("chat", "--model", path, "--prompt", "hi", "--max-tokens", 2, "--per-layer",
              "--budget", need - 1)
    assert f"below the minimum {format_bytes(need)} ({need} bytes)" in out.stderr
    assert "per-layer split" in out.stderr and "Traceback" not in out.stderr
    out = run("chat", "--model", path, "--prompt", "hi", "--max-tokens", 2, "--per-layer",
              "--budget", need)
    assert out.returncode == 0, out.stderr


def test_inspect_json_describes_the_model(tiny_model):
    out = run("inspect", "--model", tiny_model("mixtral"), "--json")
    info = json.loads(out.stdout)
    assert info["model_type"] == "mixtral"
    assert (info["moe_layers"], info["experts"], info["top_k"]) == (2, 8, 2)


def test_budget_below_minimum_is_a_clear_error_without_traceback(tiny_model):
    out = run("chat", "--model", tiny_model("qwen3_moe"), "--prompt", "hi", "--budget", "1KiB")
    assert out.returncode != 0
    assert "below the minimum 48.0 KiB" in out.stderr
    assert "Traceback" not in out.stderr


def test_corrupt_model_is_a_clear_error_without_traceback(model_copy):
    path = model_copy()
    (path / "model.safetensors").write_bytes(b"\x01\x00")
    out = run("inspect", "--model", path)
    assert out.returncode != 0
    assert "truncated safetensors file" in out.stderr
    assert "Traceback" not in out.stderr


def test_a_chat_template_that_raises_is_a_one_line_error(model_copy):
    """Templates refuse conversations with `raise_exception` (roles that do not alternate):
    jinja's TemplateError, which is no ValueError, was a traceback that ended the chat."""
    path = model_copy()
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = "{{ raise_exception('roles must alternate') }}"
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    out = run("chat", "--model", path, "--prompt", "Hello", "--max-tokens", 4)
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert "the model's chat template failed: roles must alternate" in out.stderr


@pytest.mark.parametrize("command", ["inspect", "repack"])
def test_a_tensor_mlx_cannot_load_is_a_one_line_error_naming_the_model(model_copy, command):
    """MLX raises a RuntimeError for a dtype it cannot load (F64): a traceback in inspect and
    repack, which caught ValueError and OSError only."""
    import numpy as np
    from safetensors.numpy import load_file, save_file

    path = model_copy()
    weights = load_file(path / "model.safetensors")
    weights["model.norm.weight"] = weights["model.norm.weight"].astype(np.float64)
    save_file(weights, path / "model.safetensors")
    out = run(command, "--model", path)
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert f"{path}: mlx-lm cannot load this model" in out.stderr and "F64" in out.stderr


def test_inspect_of_a_model_whose_config_cannot_be_read_is_a_one_line_error(model_copy):
    path = model_copy()
    (path / "config.json").unlink()
    (path / "config.json").mkdir()
    out = run("inspect", "--model", path)
    assert out.returncode == 1 and out.stderr.count("\n") == 1, out.stderr
    assert "Is a directory" in out.stderr and str(path / "config.json") in out.stderr


def test_chat_gives_a_base_model_without_a_chat_template_its_prompt_as_mlx_lm_does(model_copy):
    """`mlx_lm generate` encodes the prompt as it is when the tokenizer has no chat template
    (a base model's): chat answers as it does, where it refused."""
    from mlx_lm import generate, load

    path = model_copy()
    config = json.loads((path / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    out = run("chat", "--model", path, "--prompt", "Hello there", "--max-tokens", 8)
    assert out.returncode == 0, out.stderr
    model, tokenizer = load(str(path))
    assert not tokenizer.has_chat_template
    expected = generate(model, tokenizer, tokenizer.encode("Hello there"), max_tokens=8)
    assert out.stdout.startswith(expected + "\n")


@pytest.mark.parametrize("option", [("--pin-share", "0.5"), ("--prewarm-share", "0.5")])
def test_a_profile_share_without_a_profile_to_load_is_refused(tiny_model, option):
    out = run("chat", "--model", tiny_model("qwen3_moe"), "--prompt", "hi", *option)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "--prewarm-share and --pin-share need --profile load NAME" in out.stderr


def test_interactive_chat_keeps_history_and_ends_on_empty_line(tiny_model):
    proc = subprocess.run([*CLI, "chat", "-m", str(tiny_model("qwen3_moe")), "-n", "4"],
                          input="hello\nagain\n\n", capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("4 generated") == 2


def test_a_prompt_that_is_not_utf8_is_a_clear_error(tiny_model):
    """A byte that is not UTF-8 reaches Python as a surrogate, which the tokenizer refuses
    with a TypeError."""
    out = subprocess.run([*CLI, "chat", "-m", str(tiny_model("qwen3_moe")), "-n", "4",
                          "--prompt", b"ciao \xff"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert "Error: --prompt is not UTF-8 text (at character 5)" in out.stderr


@pytest.mark.parametrize("stdin_encoding", ["utf-8:surrogateescape", "utf-8"])
def test_a_line_that_is_not_utf8_is_a_clear_error_and_the_chat_goes_on(tiny_model,
                                                                       stdin_encoding):
    """Read with surrogateescape, or strictly (`utf-8`, as most locales do): the line is
    refused, and the chat neither ends nor loses the lines read ahead."""
    model = str(tiny_model("qwen3_moe"))
    out = subprocess.run([*CLI, "chat", "-m", model, "-n", "4"], input=b"ciao \xff\nhello\n\n",
                         capture_output=True, timeout=120,
                         env={**os.environ, "PYTHONIOENCODING": stdin_encoding})
    assert out.returncode == 0 and b"Traceback" not in out.stderr
    assert b"Error: the message is not UTF-8 text (at character 5)" in out.stderr
    assert out.stdout.count(b"4 generated") == 1


@pytest.mark.parametrize("temp", ["nan", "inf"])
@pytest.mark.parametrize("command", [("chat", "--prompt", "hello"), ("serve", "--port", "0")])
def test_a_temperature_that_is_not_a_finite_number_is_refused(command, temp):
    out = run(*command, "--temp", temp)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert f"Invalid value for '--temp': {temp} is not a finite number" in out.stderr


def test_an_output_that_cannot_be_saved_is_reported_once(tiny_model, tmp_path):
    proc = subprocess.run([*CLI, "chat", "-m", str(tiny_model("qwen3_moe")), "--trace",
                           str(tmp_path / "t.npz")], input="", capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.count("no complete forward call was recorded") == 1, proc.stderr


@pytest.mark.parametrize("option", [["--trace", ""], ["--profile", "save", ""]])
def test_an_output_of_an_empty_file_name_is_refused_before_the_chat(tiny_model, option):
    out = run("chat", "-m", tiny_model("qwen3_moe"), "--prompt", "hi", "-n", "1", *option)
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert out.stderr.startswith("Error: ") and "''" in out.stderr, out.stderr
    assert out.stdout == ""


def test_help_and_version_start_without_importing_mlx():
    code = ("import sys; from click.testing import CliRunner; from mlx_moestream.cli import main; "
            "runner = CliRunner(); assert runner.invoke(main, ['--help']).exit_code == 0; "
            "print(runner.invoke(main, ['--version']).output); "
            "assert 'mlx' not in sys.modules and 'mlx_lm' not in sys.modules, 'imported mlx'")
    assert "mlx-moestream, version" in python_output(code)


def test_a_chat_on_the_mlx_backend_starts_without_importing_torch(tiny_model):
    out = subprocess.run([sys.executable, "-X", "importtime", *CLI[1:], "chat", "-m",
                          tiny_model("qwen3_moe"), "--prompt", "hi", "-n", "2"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    imported = {line.rpartition("|")[2].strip() for line in out.stderr.splitlines()}
    assert "mlx_lm" in imported and "transformers" in imported
    assert "torch" not in imported


def test_a_program_that_calls_main_keeps_torch_importable_and_its_collector(tiny_model):
    model = str(tiny_model("qwen3_moe"))
    code = ("import gc; from click.testing import CliRunner; from mlx_moestream.cli import main; "
            f"result = CliRunner().invoke(main, ['inspect', '-m', {model!r}]); "
            "assert result.exit_code == 0, result.output; "
            "import torch; print(torch.ones(2).sum().item(), gc.get_freeze_count())")
    assert python_output(code).split() == ["2.0", "0"]


def test_the_program_collects_without_walking_its_backend_s_modules_or_model(tiny_model):
    """Full collections walked the objects that mlx-lm, transformers and the model make, which
    live as long as the process; the program freezes them once loaded, and collects what comes
    after. Tracked after a one-token chat: ~300 objects; 1,200 with the tiny model unfrozen,
    100,000 with nothing frozen."""
    model = str(tiny_model("qwen3_moe"))
    code = ("import gc; from mlx_moestream.cli import PROGRAM, main; "
            f"main(['chat', '-m', {model!r}, '--prompt', 'hi', '-n', '1'], obj=PROGRAM, "
            "standalone_mode=False); "
            "print(gc.get_freeze_count() > 10000, len(gc.get_objects()) < 700, gc.isenabled())")
    assert python_output(code).splitlines()[-1] == "True True True"


def test_the_backend_neutral_core_imports_with_mlx_and_torch_blocked():
    code = ("import sys\n"
            "for name in ('mlx', 'mlx_lm', 'torch', 'transformers'): sys.modules[name] = None\n"
            "import mlx_moestream.budget, mlx_moestream.cache, mlx_moestream.plan, "
            "mlx_moestream.metrics, mlx_moestream.policies, mlx_moestream.prefetch, "
            "mlx_moestream.profiles, "
            "mlx_moestream.repack, mlx_moestream.replay, mlx_moestream.runtime, "
            "mlx_moestream.stats, mlx_moestream.store, mlx_moestream.trace")
    python_output(code)


def test_chat_statistics_say_what_they_count(tiny_model, tmp_path):
    out = run("chat", "--model", tiny_model("qwen3_moe"), "--prompt", "Hello there",
              "--max-tokens", 8, "--budget", "50%", "--prefetch")
    assert out.returncode == 0, out.stderr
    assert "experts, session so far: hit rate" in out.stdout
    assert " on demand (" in out.stdout and "ms, 8 generated" in out.stdout
    assert "prefetch: " in out.stdout and "before -" not in out.stdout


def test_a_chat_answer_interrupted_by_ctrl_c_leaves_no_message_in_the_history(tiny_model):
    """The next prompt is the new message alone, as in a fresh chat: an unanswered message
    left behind would put two user turns in a row, which many chat templates refuse."""
    import re
    # long enough to be streaming when Ctrl-C comes; the next answer runs as long
    proc = subprocess.Popen([*CLI, "chat", "-m", str(tiny_model("qwen3_moe")), "-n", "400"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    proc.stdin.write("hello\n")
    proc.stdin.flush()
    seen = ""
    while ">>> " not in seen[:-20]:  # the prompt, then 20 characters of the streamed answer
        seen += proc.stdout.read(1)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate("again\n\n", timeout=120)
    assert proc.returncode == 0, err
    assert "[interrupted]" in out
    fresh = run("chat", "-m", tiny_model("qwen3_moe"), "--prompt", "again", "-n", 4)
    prompt_tokens = re.compile(r"\[(\d+) prompt tokens")
    assert prompt_tokens.findall(out) == prompt_tokens.findall(fresh.stdout)


def test_a_prompt_answer_cut_short_by_ctrl_c_ends_by_sigint(tiny_model):
    """A script running `chat --prompt` must not take a cut answer for a whole one: the
    process ends as one Ctrl-C stopped (a shell reports 130)."""
    proc = subprocess.Popen([*CLI, "chat", "-m", str(tiny_model("qwen3_moe")), "-n", "2000",
                             "--prompt", "hello"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout.read(20)  # the answer streams
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGINT, err
    assert "[interrupted]" in out and "Traceback" not in err


def test_an_answer_whose_reader_stops_reading_ends_quietly(tiny_model):
    """`chat --prompt ... | head -1`: the pipe closing is the reader's choice, no error."""
    proc = subprocess.Popen([*CLI, "chat", "-m", str(tiny_model("qwen3_moe")), "-n", "2000",
                             "--prompt", "hello"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout.read(20)  # the answer streams
    proc.stdout.close()  # as `head` exits
    err = proc.stderr.read()
    proc.wait(timeout=120)
    assert proc.returncode == 1 and "Error" not in err and "Traceback" not in err, err


def test_chat_with_its_standard_input_closed_answers(tiny_model):
    """`chat --prompt ... <&-`: the model's file took descriptor 0, which MLX refuses."""
    out = subprocess.run([*CLI, "chat", "-m", str(tiny_model("qwen3_moe")), "--prompt", "hello",
                          "-n", "4"], capture_output=True, text=True, timeout=120,
                         preexec_fn=lambda: os.close(0))
    assert out.returncode == 0, out.stderr
    assert "4 generated" in out.stdout


def test_ctrl_c_while_the_model_loads_ends_by_sigint(tiny_model):
    code = ("import os; from mlx_moestream import cli; "
            "os.preadv = lambda *a: (_ for _ in ()).throw(KeyboardInterrupt()); cli.run()")
    out = subprocess.run([sys.executable, "-c", code, "chat", "-m", str(tiny_model("qwen3_moe")),
                          "--prompt", "hello"], capture_output=True, text=True, timeout=120)
    assert out.returncode == -signal.SIGINT, out.stderr
    assert out.stderr.endswith("\n[interrupted]\n") and "Aborted" not in out.stderr


def test_ctrl_c_in_main_called_by_a_program_is_status_130(tiny_model, monkeypatch):
    """A program that calls `main` (a test's runner) gets the status, not a KeyboardInterrupt
    that would end it too."""
    from click.testing import CliRunner

    from mlx_moestream import cli

    monkeypatch.setattr(os, "preadv", lambda *a: (_ for _ in ()).throw(KeyboardInterrupt()))
    result = CliRunner().invoke(cli.main, ["chat", "-m", str(tiny_model("qwen3_moe")),
                                           "--prompt", "hello"])
    assert result.exit_code == 130, result.output


def test_a_shell_loop_stops_at_a_command_ctrl_c_stopped(tiny_model):
    """Ctrl-C at a terminal reaches the shell and the command. bash waits for the command and
    stops its loop when the command died of SIGINT; one that exited, 130 included, handled the
    signal as its own business, and the loop runs its next round."""
    command = shlex.join([*CLI, "chat", "-m", str(tiny_model("qwen3_moe")), "-n", "400",
                          "--prompt", "hello"])
    proc = subprocess.Popen(["bash", "-c", f"for i in 1 2; do {command}; echo round $i; done"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # its own group: the terminal's, here
    assert proc.stdout.read(20)  # the answer streams
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=240)
    assert "[interrupted]" in out and "round" not in out, out + err


@pytest.mark.parametrize("name, message", [
    ("notes.png", "refusing to replace {path}: it is not a plot mlx-moestream wrote"),
    ("photo.png", "refusing to replace {path}: it is not a plot mlx-moestream wrote"),
    ("sweep.txt", "{path}: plots are written as PNG: give a .png path"),
    ("missing/sweep.png", "cannot write {path}: no folder"),
])
def test_replay_plot_refuses_a_target_it_must_not_write_before_the_sweep(tmp_path, name, message):
    """A photo.png of the user's is a PNG, which the plot replaced."""
    from mlx_moestream.trace import synthetic_trace

    synthetic_trace(64, 2, 8, 2, seed=0).save(tmp_path / "t.npz")
    notes, photo = tmp_path / "notes.png", tmp_path / "photo.png"
    notes.write_text("my notes")
    shutil.copy(ROOT / "docs" / "embedded-routing.png", photo)
    before = photo.read_bytes()
    path = tmp_path / name
    out = run("replay", tmp_path / "t.npz", "--sweep", "--plot", path)
    assert out.returncode != 0 and "Traceback" not in out.stderr
    assert message.format(path=path) in out.stderr
    assert "policy" not in out.stdout  # refused before the sweep
    assert notes.read_text() == "my notes" and not (tmp_path / "sweep.txt").exists()
    assert photo.read_bytes() == before


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full (Linux only)")
@pytest.mark.parametrize("args", [["inspect"], ["--version"]])
def test_output_that_cannot_be_written_is_a_one_line_error(args):
    """A full disk under `> file`: click ends quietly on a closed pipe only, and let this out
    as a traceback."""
    with open("/dev/full", "w") as full:
        out = subprocess.run([*CLI, *args], stdout=full, stderr=subprocess.PIPE, text=True,
                             timeout=120)
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert out.stderr == "Error: cannot write the output: No space left on device\n"


@pytest.mark.parametrize("args, message", [
    (["--model", ""], "no model given: the name is empty"),  # it loaded the current folder
    (["--device", "cuda"], "--device is the torch backend's"),  # MLX ignored it
])
def test_chat_options_that_would_be_ignored_or_misread_are_refused(args, message):
    out = run("chat", "--prompt", "hi", *args)
    assert out.returncode in (1, 2) and "Traceback" not in out.stderr
    assert message in out.stderr and "hit rate" not in out.stdout


def test_package_imports_from_a_checkout_with_no_installed_metadata():
    """The scripts put the checkout on `sys.path`; the package may not be installed."""
    code = ("import importlib.metadata as metadata\n"
            "def missing(name): raise metadata.PackageNotFoundError(name)\n"
            "metadata.version = missing\n"
            "import mlx_moestream\n"
            "print(mlx_moestream.__version__)")
    assert python_output(code).strip() == "0+checkout"
