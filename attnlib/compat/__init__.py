"""Drop-in float64 references in the callers' own conventions, each with an assert twin.

========================================  ====================================================
module                                     the peer's API
========================================  ====================================================
`attnlib.compat.flash_attn`               FlashAttention 2 (``flash_attn``)
`attnlib.compat.flash_attn_interface`     FlashAttention 3 (``hopper/flash_attn_interface``)
`attnlib.compat.flash_attn_cute`          FlashAttention 4 (``flash_attn.cute``)
`attnlib.compat.pytorch`                  PyTorch SDPA and FlexAttention
`attnlib.compat.vllm`                     vLLM's paged test reference ``ref_paged_attn``
`attnlib.compat.flashinfer`               FlashInfer's single and batch prefill/decode
========================================  ====================================================

Each function has its peer's signature and returns what the peer returns (layout, tuple,
LSE base and empty-row value), computed exactly in float64 by attnlib's tiled kernel on the
caller's arrays (torch tensors on their device; results float64 tensors of the same kind).
Each ``assert_<name>_close(result, <the same arguments>, **check)`` judges a kernel's result
with `attnlib.testing.assert_attention_close`'s rule.  The conventions, and where they differ
from the peers' own test references: `docs/semantics.md`, "Drop-in references".
"""
