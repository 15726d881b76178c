"""The shipped model is a real qwen3_moe whose routing depends on the language.

Per-workload caching profiles only mean something if Italian, English and code pick different
experts; these tests measure that with the runtime's own routing counts on the shipped model
and held-out text, not on stored numbers.
"""

from functools import cache

import mlx_lm
import pytest

import mlx_moestream
from mlx_moestream.hub import EMBEDDED_MODEL
from mlx_moestream.profiles import js_divergence

MAX_BYTES = 20 * 1024 * 1024


def heldout(workload: str) -> str:
    """The first half of the workload's held-out text (about 1,500 tokens): across languages
    its routing differs 5-6x more than between its own two halves, against the 3x asked, at
    half the time of the whole text on a CPU."""
    text = (EMBEDDED_MODEL / "heldout" / f"{workload}.txt").read_text(encoding="utf-8")
    return text[: len(text) // 2]


@cache  # the Italian halves serve every comparison: each takes seconds on a CPU
def routing_counts(text: str):
    """[layers, experts] tokens routed to each expert while the runtime reads `text`."""
    model, tokenizer = mlx_moestream.load(budget="100%")
    mlx_moestream.run_text(model, tokenizer, text)
    return mlx_moestream.profile(model, "test").counts


def test_size_on_disk_within_budget():
    total = sum(p.stat().st_size for p in EMBEDDED_MODEL.rglob("*") if p.is_file())
    assert total <= MAX_BYTES


def test_loads_with_stock_mlx_lm_as_qwen3_moe():
    model, tokenizer = mlx_lm.load(str(EMBEDDED_MODEL))
    moe_layers = [l for l in model.model.layers if hasattr(l.mlp, "switch_mlp")]
    assert model.args.model_type == "qwen3_moe"
    assert len(moe_layers) >= 4
    assert model.args.num_experts >= 16
    assert tokenizer.eos_token == "<|im_end|>"


def test_chat_template_opens_assistant_turn():
    _, tokenizer = mlx_moestream.load(budget="100%")
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Ciao"}], add_generation_prompt=True, tokenize=False
    )
    assert prompt == "<|im_start|>user\nCiao<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("other", ["python", "english"])
def test_routing_depends_on_language(other):
    """JS over the joint (layer, expert) distribution: Italian vs another workload well above
    the noise between two halves of the Italian text."""
    text = heldout("italian")
    first = routing_counts(text[: len(text) // 2]).reshape(-1)
    second = routing_counts(text[len(text) // 2 :]).reshape(-1)
    across = float(js_divergence(first + second, routing_counts(heldout(other)).reshape(-1)))
    within = float(js_divergence(first, second))
    assert across >= 3 * within, (across, within)
