"""Every command the README shows runs as written, in order, section by section, in one folder
per section, as a shell that ran the README's first command would run it.

Each command line of a ```bash block is split on ` && `; each part goes to the handler of its
prefix (HANDLERS). A part no handler claims fails `test_every_readme_command_has_a_handler`:
a new kind of command needs a handler here before the README may show it. Installs are not
run again: they are checked against `.ci/run`, which runs the README's test command exactly.
Every ```python block runs too, after the bash blocks before it in its section. A hub id would
need a download: HUB_MODELS maps each one shown to a tiny local model of its architecture
(the commands run with HF_HUB_OFFLINE=1, so one left unmapped fails).
"""

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from test_serve import free_port

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
CI = (ROOT / ".ci" / "run").read_text()
TIMEOUT = 300

# hub id -> the tiny model (tests/conftest.py's `tiny_model` arguments) that stands for it
HUB_MODELS = {"mlx-community/Qwen3-30B-A3B-4bit": ("qwen3_moe", {"bits": 4})}
HUB_ID = re.compile(r"\b(?:mlx-community|Qwen|mistralai|deepseek-ai|openai|allenai)/[\w.-]+")
COMMANDS = ("mlx-moestream ", "mlx.launch ", "python ", "python3 ", "pip ", ". ")


def sections(text: str) -> list[tuple[str, list[tuple[str, str]]]]:
    """(`## ` heading, its ```bash and ```python blocks in order); the text before the first
    heading is the section ''."""
    out = []
    for i, part in enumerate(re.split(r"^## ", text, flags=re.M)):
        heading, _, body = part.partition("\n") if i else ("", "", part)
        blocks = re.findall(r"^```(bash|python)\n(.*?)^```", body, re.M | re.S)
        out.append((heading.strip(), blocks))
    return out


def command_parts(text: str) -> list[str]:
    """Every command of every ```bash block, in order, each line split on ` && `."""
    parts = []
    for _, blocks in sections(text):
        for lang, body in blocks:
            if lang == "bash":
                for line in body.splitlines():
                    assert not line.rstrip().endswith("\\"), f"one command per line: {line}"
                    if line.strip():
                        parts += [p.strip() for p in line.split(" && ")]
    return parts


def bash_lines(text: str) -> list[str]:
    return [body.strip() for _, blocks in sections(text) for lang, body in blocks
            if lang == "bash"]


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def ci_command() -> str:
    """The command `.ci/run` runs: its last line."""
    return CI.strip().splitlines()[-1]


class Shell:
    """One section's folder and environment: profiles saved by name land in the folder, no
    download is attempted, hub ids are replaced by tiny local models, and the README's port
    8080 by a free one; commands started in the background end with the section."""

    def __init__(self, cwd: Path, tiny_model):
        self.cwd, self.tiny_model = cwd, tiny_model
        self.env = {**os.environ, "MLX_MOESTREAM_PROFILES": str(cwd), "HF_HUB_OFFLINE": "1"}
        self.port = str(free_port())
        self.background: list[subprocess.Popen] = []

    def local(self, text: str) -> str:
        for hub_id in HUB_ID.findall(text):
            assert hub_id in HUB_MODELS, f"{hub_id}: add a tiny stand-in to HUB_MODELS"
            arch, kwargs = HUB_MODELS[hub_id]
            text = text.replace(hub_id, str(self.tiny_model(arch, **kwargs)))
        return re.sub(r"(127\.0\.0\.1:|--port )8080\b", rf"\g<1>{self.port}", text)

    def stop(self) -> None:
        """End the background commands as Ctrl-C would, each saying it saved what it writes."""
        for process in self.background:
            process.send_signal(signal.SIGINT)
            out, err = process.communicate(timeout=60)
            assert "Traceback" not in err, err[-3000:]

    def run(self, argv: list, stdin: str | None = None) -> subprocess.CompletedProcess:
        done = subprocess.run([str(a) for a in argv], cwd=self.cwd, env=self.env, input=stdin,
                              capture_output=True, text=True, timeout=TIMEOUT)
        assert done.returncode == 0, (argv, done.stdout[-2000:], done.stderr[-3000:])
        return done


def check_install(shell: Shell | None, part: str) -> None:
    """Not run again (this environment is the installed one): what it installs is what
    `.ci/run` installs, the same pins and no extra it lacks."""
    ci_parts = ci_command().split(" && ")
    if not part.startswith("pip install "):
        assert part in ci_parts, f"{part!r} is not in .ci/run"
        return
    ci_args = [shlex.split(p)[2:] for p in ci_parts if p.startswith("pip install ")]
    ci_pins = {a for args in ci_args for a in args if "==" in a}
    ci_extras = {e for args in ci_args for a in args if a.startswith(".[")
                 for e in a[2:-1].split(",")}
    for arg in shlex.split(part)[2:]:
        if "==" in arg:
            assert arg in ci_pins, f"{part!r}: {arg} is not .ci/run's pin {ci_pins}"
        elif arg.startswith(".["):
            assert set(arg[2:-1].split(",")) <= ci_extras, f"{part!r}: extras not in .ci/run"
        else:
            assert arg in ("-q", "-e", "."), f"{part!r}: {arg} is not in .ci/run"


def check_test_command(shell: Shell | None, part: str) -> None:
    """The test command itself (this suite): not run again here; .ci/run runs it."""
    assert part == "python -m pytest -q -n 2"
    assert ci_command().endswith(" && " + part)


def needs_torch(text: str) -> None:
    if "torch" in text:
        pytest.importorskip("torch")
        pytest.importorskip("transformers")


def run_cli(shell: Shell, part: str) -> None:
    """`mlx-moestream ARGS` as `python -m mlx_moestream.cli ARGS`; an interactive chat gets
    one message, then the end of its input."""
    args = shlex.split(shell.local(part))[1:]
    if "--backend" in args and args[args.index("--backend") + 1] == "torch":
        needs_torch("torch")
    interactive = args[0] == "chat" and "--prompt" not in args
    done = shell.run([sys.executable, "-m", "mlx_moestream.cli", *args],
                     stdin="Ciao, come stai?\n" if interactive else None)
    if args[0] == "chat":
        assert "hit rate" in done.stdout, done.stdout[-2000:]


def run_launch(shell: Shell, part: str) -> None:
    """`mlx.launch OPTIONS -- mlx-moestream ARGS`: the venv's launcher (conftest puts this
    python's folder first on PATH), each host `python -m mlx_moestream.cli ARGS`."""
    args = shlex.split(part)
    split = args.index("--")
    host = args[split + 1:]
    assert host[0] == "mlx-moestream", part
    launcher = shutil.which("mlx.launch")
    assert launcher, "mlx.launch is not on PATH"
    done = shell.run([launcher, *args[1:split], "--", sys.executable, "-m",
                      "mlx_moestream.cli", *host[1:]])
    assert "Node with rank" not in done.stderr, done.stderr[-3000:]
    assert done.stdout.count("generated at") == 1 and "all 2 hosts" in done.stdout


def run_server(shell: Shell, part: str) -> None:
    """`mlx-moestream serve ARGS &`: started in the background, until it answers at its port."""
    assert part.endswith(" &"), f"{part!r}: a server runs in the background (&)"
    args = shlex.split(shell.local(part.removesuffix("&")))[1:]
    process = subprocess.Popen([sys.executable, "-m", "mlx_moestream.cli", *args], cwd=shell.cwd,
                               env=shell.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
    shell.background.append(process)
    for _ in range(TIMEOUT * 10):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{shell.port}/v1/models", timeout=5)
            return
        except OSError:
            assert process.poll() is None, process.communicate()[1][-3000:]
            time.sleep(0.1)
    raise AssertionError(f"{part!r} never answered")


def run_python_c(shell: Shell, part: str) -> None:
    _, flag, code = shlex.split(shell.local(part))
    assert flag == "-c"
    needs_torch(code)
    shell.run([sys.executable, "-c", code])


def run_script(shell: Shell, part: str) -> None:
    """`python FILE ARGS`: FILE is the checkout's (the README's commands run from its root);
    what it writes lands in the section's folder."""
    _, script, *args = shlex.split(shell.local(part))
    assert (ROOT / script).is_file(), f"{part!r}: no {script} in the checkout"
    shell.run([sys.executable, ROOT / script, *args])


# (prefix, handler), first match wins; a command no prefix matches fails the test below
HANDLERS = [
    ("python3 -m venv ", check_install),
    (". .venv/bin/activate", check_install),
    ("pip install ", check_install),
    ("python -m pytest", check_test_command),
    ("mlx-moestream serve ", run_server),
    ("mlx-moestream ", run_cli),
    ("mlx.launch ", run_launch),
    ("python -c ", run_python_c),
    ("python ", run_script),
]


def handler(part: str):
    return next((h for prefix, h in HANDLERS if part.startswith(prefix)), None)


def test_every_readme_command_has_a_handler():
    fences = re.findall(r"^```(\w*)\n.*?^```", README, re.M | re.S)
    assert set(fences) <= {"bash", "python"}, f"blocks no test runs: {fences}"
    parts = command_parts(README)
    assert parts, "the README shows no ```bash block"
    unknown = [p for p in parts if handler(p) is None]
    assert not unknown, f"commands no test runs (add a handler to HANDLERS): {unknown}"


def test_inline_commands_are_those_the_blocks_run():
    """A command shown `inline` is one a ```bash block shows (and so one a test runs)."""
    shown = set(command_parts(README))
    inline = [c for c in re.findall(r"`([^`\n]+)`", README) if c.startswith(COMMANDS)]
    assert not [c for c in inline if c not in shown], inline


def test_the_readme_starts_with_the_main_job_then_the_tests():
    first, second = bash_lines(README)[:2]
    assert first.startswith("python3 -m venv .venv && . .venv/bin/activate && pip install ")
    assert first.split(" && ")[-1].startswith("mlx-moestream chat ")
    assert "\n" not in second and second == ci_command()


def test_ci_runs_exactly_the_readme_test_command():
    lines = [line for line in CI.splitlines() if line and not line.startswith("#")]
    assert lines == ["set -euo pipefail", 'cd "$(dirname "$0")/.."', bash_lines(README)[1]]


RUNNABLE = [(heading or "top", blocks) for heading, blocks in sections(README) if blocks]


@pytest.mark.parametrize("heading, blocks", RUNNABLE, ids=[anchor(h) for h, _ in RUNNABLE])
def test_the_readme_section_runs_as_written(heading, blocks, tiny_model, tmp_path):
    shell = Shell(tmp_path, tiny_model)
    try:
        for lang, body in blocks:
            if lang == "python":
                needs_torch(body)
                shell.run([sys.executable, "-c", shell.local(body)])
                continue
            for line in body.splitlines():
                for part in filter(None, (p.strip() for p in line.split(" && "))):
                    handler(part)(shell, part)
    finally:
        shell.stop()
    if heading == "Python API":
        assert (tmp_path / "my-workload.json").exists()


def test_the_python_api_example_names_one_hub_model_twice():
    """The example loads a real model; the test above runs it on a tiny one of its kind."""
    block = re.search(r"^## Python API\n\n```python\n(.*?)\n```", README, re.S | re.M).group(1)
    assert block.count('"mlx-community/Qwen3-30B-A3B-4bit"') == 2


@pytest.mark.parametrize("doc", ["README.md", *sorted(
    str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))])
def test_links_reach_a_file_and_heading(doc):
    path = ROOT / doc
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.M | re.S)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+://", target):
            continue
        file, _, fragment = target.partition("#")
        linked = (path.parent / file).resolve() if file else path
        assert linked.exists(), f"{doc}: {target}"
        if fragment:
            headings = re.findall(r"^#+ (.*)$", linked.read_text(), re.M)
            assert fragment in {anchor(h) for h in headings}, f"{doc}: {target}"


def test_the_cli_table_names_every_subcommand_and_option():
    """Each subcommand of the program has a row of the README's CLI table, and the row names
    each of its options (by one of its names) but --help."""
    import click

    from mlx_moestream.cli import main

    table = re.search(r"^## CLI reference\n(.*?)^## ", README, re.M | re.S).group(1)
    rows = {}
    for line in table.splitlines():
        cells = line.split(" | ")
        if line.startswith("| `") and len(cells) == 3:
            words = cells[0].strip("| `").split()
            rows[" ".join(words[:2] if words[0] == "profile" else words[:1])] = cells[2]
    commands = {}
    for name, command in main.commands.items():
        for sub_name, sub in getattr(command, "commands", {None: command}).items():
            commands[f"{name} {sub_name}" if sub_name else name] = sub
    assert set(rows) == set(commands), (sorted(rows), sorted(commands))
    for name, command in commands.items():
        missing = [p.opts for p in command.params if isinstance(p, click.Option)
                   and not any(re.search(rf"(?<![\w-]){re.escape(o)}(?![\w-])", rows[name])
                               for o in p.opts)]
        assert not missing, f"{name}: options {missing} not in the README's CLI table"
