"""Generate with the embedded model while its experts stream from disk under a 30% budget.

The model and tokenizer that `mlx_moestream.load` returns work with mlx-lm unchanged.
"""

import mlx_lm

import mlx_moestream

model, tokenizer = mlx_moestream.load(budget="30%", profile="italian-chat")

print(mlx_lm.generate(model, tokenizer, "Ciao, come stai?", max_tokens=32))
for response in mlx_lm.stream_generate(model, tokenizer, "def fibonacci(n):", max_tokens=32):
    print(response.text, end="", flush=True)
print()

stats = mlx_moestream.stats(model)
print(f"hit rate {stats['hit_rate']:.1%}: {stats['loads']} experts read, "
      f"{stats['resident_bytes']} of a {stats['budget_bytes']}-byte budget resident")
