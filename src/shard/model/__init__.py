"""The model runtime: config, stage modules, KV cache, loading, wire tensors.

    config.py       ModelConfig / RopeScaling from a HF config.json (imports no torch)
    families.py     each family's declared differences from a Llama, and MoeConfig (no torch)
    llama.py        StageModel -> Block, in plain torch
    attention.py    rope tables (llama3/yarn/linear), RMSNorm variants, Attention
    moe.py          FeedForward, SparseMoE (routers, experts run per row group)
    kvcache.py      KVCache: one stage's static cache for one session; rollback by overwrite
    loader.py       load_stage: read only one block's tensors from safetensors
    tensors.py      torch.Tensor <-> shard.messages.Tensor (raw bytes, never pickle)
    tokenizer.py    tokenizer.json encode/decode and the model's chat template (no torch)
    gguf_import.py  GGUF -> safetensors checkpoint conversion
    gguf_vocab.py   a GGUF's tokenizer metadata -> tokenizer.json (for gguf_import)
    bundled.py      find a model by name or path (the shipped SmolLM2)

This file imports nothing, so ``import shard.model.config`` stays torch-free.
"""
