"""The torch backend: transformers MoE models whose experts stream from the checkpoint.

`load()` builds the transformers model without touching its weights' memory (transformers'
`no_init_weights`), copies in the dense weights, and gives each fused experts module
(`@use_experts_implementation`: Qwen2/3-MoE, Mixtral, OLMoE, DeepSeek-V3, gpt-oss) `[E, ...]`
tensors over anonymous memory maps. Rows of resident experts are read from the store, an evicted
expert's pages go back to the OS (`MADV_DONTNEED`), untouched rows cost no memory. The module
then computes exactly as in the fully loaded model, on the same expert ids and the same bytes,
with whatever experts implementation the model uses (eager, grouped_mm, batched_mm): its
outputs are the same bit for bit. Before each call the runtime makes its routed experts
resident. A call is never split (that would change the implementation's sums), so the budget
must hold one layer's experts.

On a GPU (`device="cuda"`) the experts cannot stay indexed by id (that needs memory for all of
them), so each group of layers with one expert shape shares a `[slots, ...]` pool in device
memory (`DeviceSlots`), the routed ids are remapped to slots, and reads land in pinned host
buffers copied to their slots on a side stream the compute waits for. Measured on H100 and
H200 GPUs (`scripts/check_cuda.py`): grouped_mm and batched_mm compute each routed row alone,
so a plain remap is bit-exact; eager adds the experts' outputs in expert order, so its call
gets the used slots gathered in expert-id order (an order-preserving remap).

The modules by job: `loader` (the load, the plan and the minimum budget), `build` (the model
rebuilt from transformers' internals, dense weights only), `layout` (which expert parameter
each checkpoint tensor fills), `pools` (rows by id or device slot pools), `forward` (a streamed
call) and `guards` (what a streamed model refuses after load).
"""

from .loader import load, min_budget_bytes, plan_of

__all__ = ["load", "min_budget_bytes", "plan_of"]
