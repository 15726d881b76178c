"""The shipped profiles on the shipped model: the right one raises the early hit rate."""

import sys
from pathlib import Path

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.models.cache import make_prompt_cache

import mlx_moestream

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from record_profiles import hits_per_token, split  # noqa: E402

PROFILES = Path(__file__).resolve().parents[1] / "profiles"


@pytest.fixture(scope="module")
def italian_ids():
    _, tokenizer = mlx_moestream.load(budget="100%")
    return tokenizer.encode(split("italian")[1])[:64]


def test_italian_profile_raises_hit_rate_of_first_64_italian_tokens(italian_ids):
    cold = hits_per_token(None, italian_ids, "30%").mean()
    warm = hits_per_token(PROFILES / "italian-chat.json", italian_ids, "30%").mean()
    assert warm > cold


def test_outputs_are_identical_with_and_without_a_profile(italian_ids):
    logits = []
    for profile in (None, "python-code", "italian-chat"):
        model, _ = mlx_moestream.load(budget="30%", profile=profile)
        cache = make_prompt_cache(model)
        out = [model(mx.array([[t]]), cache=cache) for t in italian_ids[:32]]
        mx.eval(out)
        logits.append(out)
    assert all(mx.array_equal(a, b).item() for other in logits[1:] for a, b in zip(logits[0], other))


@pytest.mark.parametrize("name", ["italian-chat", "english-chat", "python-code"])
def test_shipped_profiles_match_the_embedded_model(name):
    model, _ = mlx_moestream.load(budget="30%", profile=name)
    assert mlx_moestream.stats(model)["prewarm"]["experts"] > 0


def test_a_budget_for_every_expert_split_per_layer_by_a_profile_holds_every_expert():
    """A skewed profile gave its widest layer more slots than it has experts: the budget held
    all of them, yet the narrowest layer kept evicting."""
    model, tokenizer = mlx_moestream.load(budget="100%", per_layer=True, profile="python-code")
    mlx_lm.generate(model, tokenizer, "def f(x):\n    return x", max_tokens=48)
    stats = mlx_moestream.stats(model)
    assert stats["evictions"] == 0 and stats["loads"] == stats["slots"]
