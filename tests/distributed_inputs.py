"""Run by tests/test_distributed.py on two hosts over the ring backend: the hosts are fed
apart, as a script that reads its prompt on each host, or seeds each host apart, feeds them:
`tokens` (host 1's prompt has another token), `length` (host 1's prompt is a token shorter) or
`seed` (each host samples with its own seed).
Each host prints, in one line, the tokens it generated or its error."""

import sys

sys.modules["torch"] = None  # hosts run MLX alone: transformers starts as without torch

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_sampler

import mlx_moestream
from mlx_moestream.testing import PROMPT_IDS

path, mode = sys.argv[1], sys.argv[2]
model, _ = mlx_moestream.load(path, budget="60%", distributed=True, timeout_seconds=30)
host = model.moestream.host[0]
prompt = mx.array(PROMPT_IDS[0, :8])
if mode == "tokens" and host == 1:
    prompt[3] = prompt[3] + 1
if mode == "length" and host == 1:
    prompt = prompt[1:]
if mode == "seed":
    mx.random.seed(host)
tokens = []
try:
    for token, _ in generate_step(prompt, model, max_tokens=16,
                                  sampler=make_sampler(temp=1.0 if mode == "seed" else 0.0)):
        tokens.append(int(token))
except ValueError as e:
    print(f"host {host}: after {len(tokens)} tokens: Error: {e}", flush=True)
else:
    print(f"host {host}: {tokens}", flush=True)
