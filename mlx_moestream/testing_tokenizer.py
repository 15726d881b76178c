"""A tokenizer trained here with `tokenizers`, for the tiny test checkpoints of either backend.

Its own module: it imports neither mlx nor torch, so a machine with only one of them (a CUDA
machine with torch) can build checkpoints.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Enough distinct byte pairs for a 512-token BPE; mixed languages and code so that
# tokenization looks like a real chat model's, not a single-language toy.
_TRAINING_TEXT = """\
The quick brown fox jumps over the lazy dog. Mixture-of-experts models route every token
to a few experts, so only a small part of the weights is needed for each step. Streaming those
weights from disk lets a large model run on a machine with little memory, as long as the cache
keeps the experts that are used most often.
La volpe veloce salta sopra il cane pigro. I modelli a miscela di esperti inviano ogni parola a
pochi esperti, quindi serve solo una piccola parte dei pesi a ogni passo. Leggere i pesi dal disco
permette di usare un modello grande su una macchina con poca memoria.
def route(scores, k):
    order = sorted(range(len(scores)), key=lambda i: -scores[i])
    return order[:k]

for layer in range(4):
    print(f"layer {layer}: {route([0.1, 0.7, 0.2], 2)}")
"""


def make_tokenizer(path, vocab_size: int = 512, texts: Iterable[str] | None = None,
                   min_frequency: int = 0) -> None:
    """Train a byte-level BPE with `tokenizers` and save the HF tokenizer files with a ChatML template.

    `texts` defaults to a small built-in multilingual text, which stops yielding merges at 573
    tokens; a larger model vocab still loads, its extra ids just decode to nothing.
    """
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=min_frequency,
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts or [_TRAINING_TEXT], trainer)

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "additional_special_tokens": SPECIAL_TOKENS,
        "model_max_length": 2048,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHATML_TEMPLATE,
    }
    with open(path / "tokenizer_config.json", "w") as f:
        json.dump(tokenizer_config, f, indent=2)
    with open(path / "special_tokens_map.json", "w") as f:
        json.dump({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}, f, indent=2)
