"""`chat`'s reply loops: one answer streamed by mlx-lm or by transformers, with its timing."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import click
from jinja2 import TemplateError

if TYPE_CHECKING:
    from mlx_lm.generate import GenerationResponse


@dataclass
class Timing:
    """What `format_stats` shows of a torch answer: the fields of mlx-lm's response."""

    prompt_tokens: int
    prompt_tps: float
    generation_tokens: int
    generation_tps: float


def mlx_reply(lm, tokenizer, max_tokens: int, temp: float,
              history: list[dict]) -> tuple[str, GenerationResponse]:
    """Stream an mlx-lm answer to `history`; returns its text and mlx-lm's last response."""
    from mlx_lm import stream_generate
    from mlx_lm.sample_utils import make_sampler

    tokens = _prompt_tokens(tokenizer, history, tokenizer.has_chat_template)
    reply = []
    for response in stream_generate(lm, tokenizer, tokens, max_tokens=max_tokens,
                                    sampler=make_sampler(temp=temp)):
        click.echo(response.text, nl=False)
        reply.append(response.text)
    click.echo()
    return "".join(reply), response


def torch_reply(lm, tokenizer, max_tokens: int, temp: float,
                history: list[dict]) -> tuple[str, Timing]:
    """Stream a transformers `generate()` answer to `history`; returns its text and timing.

    Decode speed counts from the first generated token, as mlx-lm counts it, so that a slow
    prompt does not make a fast decode look slow.
    """
    import torch
    from transformers import TextStreamer

    class Echo(TextStreamer):
        first = None  # when the first generated token came: the prompt's time ends there

        def put(self, value) -> None:
            if not self.next_tokens_are_prompt and self.first is None:
                self.first = time.perf_counter()
            super().put(value)

        def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
            click.echo(text, nl=stream_end)

    tokens = _prompt_tokens(tokenizer, history, tokenizer.chat_template is not None,
                            tokenize=True, return_dict=False)
    streamer = Echo(tokenizer, skip_prompt=True, skip_special_tokens=True)
    start = time.perf_counter()
    out = lm.generate(torch.tensor([tokens], device=lm.device), max_new_tokens=max_tokens,
                      do_sample=temp > 0, temperature=temp or None, streamer=streamer,
                      pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
    end, first = time.perf_counter(), streamer.first or time.perf_counter()
    generated = out.shape[-1] - len(tokens)
    text = tokenizer.decode(out[0, len(tokens):], skip_special_tokens=True)
    return text, Timing(len(tokens), len(tokens) / max(first - start, 1e-9), generated,
                        generated / max(end - first, 1e-9))


def _prompt_tokens(tokenizer, history: list[dict], templated: bool, **options) -> list[int]:
    """The conversation as prompt tokens, through the tokenizer's chat template.

    A base model's tokenizer has none: its turns' text as it is then, as `mlx_lm generate` does.
    """
    if templated:
        try:
            return tokenizer.apply_chat_template(history, add_generation_prompt=True, **options)
        except TemplateError as e:  # a template's own `raise_exception`, or one that is broken
            raise ValueError(f"the model's chat template failed: {e}") from None
    return tokenizer.encode("\n".join(turn["content"] for turn in history))
