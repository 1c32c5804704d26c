"""The model runtime: families, stage modules, weights kept quantized, loading, tokenizer.
Checkpoints come in as safetensors; turning a GGUF into one is ``shard.convert``'s, which the
runtime never imports.

    config.py       ModelConfig / RopeScaling from a HF config.json (imports no torch)
    hf_config.py    a ModelConfig written back as a Llama/Qwen2/Mistral config.json (no torch)
    config_fields.py  a config.json's fields read typed and bounded (Fields, ModelLoadError)
    rope_config.py  RopeScaling read from rope_scaling / rope_parameters (YaRN mscale too)
    families.py     each family's declared differences, MoeConfig, MlaConfig, DsaConfig (no torch)
    hybrid_config.py  Qwen3-Next / Qwen3.5-MoE's differences, LinearAttnConfig (no torch)
    families_v4.py  V4Config: DeepSeek-V4's streams, attention kinds, hash layers (no torch)
    jsonfile.py     JSON model files read with size and nesting bounds (no torch)
    llama.py        StageModel -> Block, in plain torch
    attention.py    rope tables (llama3/yarn/linear), RMSNorm variants, Attention
    mla.py          MLAttention: DeepSeek-V3's latent attention, its cache the latent
    dsa.py          Indexer: GLM-5's sparse attention, each query's top-k keys, row-invariant
    deltanet.py     GatedDeltaNet: Qwen3-Next's linear attention, a state instead of a KV cache
    recurrent.py    RecurrentCache: that state per session, kept so that a session can roll back
    masks.py        causal masks of a chunk (eager, and over a whole cache for CUDA graphs)
    deepseek_v4.py  V4Stage -> V4Block: hyper-connected streams and token ids cross every hop
    hyper.py        hyper-connections: collapse, merge and the final head of V4's streams
    v4_attention.py V4Attention: sliding K=V plus CSA/HCA entries, position-addressed state
    v4_moe.py       V4MoE: hash (tid2eid) or top-k routers, clamped SwiGLU experts
    moe.py          FeedForward, SparseMoE (routers, experts run per row group)
    linear.py       Linear: nn.Linear whose one-row bf16 products sum as many-row ones do
    packed.py       one forward for many sessions' chunks, each attending to its own cache
    kvcache.py      KVCache: one stage's static cache for one session; rollback by overwrite
    quant.py        weights kept packed: int4 and int8 linears and a row-gathering embedding
    q8.py           int8 weights in groups, packed, times rows rounded to int16 (C++, torch)
    rowattn.py      a short chunk's attention, each row in one stated order (C++, torch)
    fused.py        q/k/v and gate/up products joined into one, the same bytes each
    held.py         int4 weights in groups of 16 held dequantized, up to 16 MiB a layer
    native.py       a Llama-family stage's layers in C++ (native_step.cpp): same bytes, faster
    native_build.py the C++ extension (native_step, native_q8, native_attn.cpp) built on first use
    fp8.py          published FP8 weights with block scales (weight_scale_inv), kept stored
    weights.py      the ``weights`` option, how it combines with ``dtype``, its default
    loader.py       load_stage: read only one block's tensors, in the chosen ``weights``
    safetensors_header.py  the one checked reader of safetensors headers, indexes, quant tables
    tensorfile.py   a safetensors file read tensor by tensor into memory torch owns
    heap.py         freed temporaries handed back to the OS while a stage loads, kept after
    footprint.py    what a block weighs in memory, predicted from config.json (or headers)
    stored_headers.py  each weight of a stored checkpoint as its header describes it
    profile.py      what one layer costs a node: its weight bytes and measured time
    device.py       a node's spec'd device and dtype as torch values, checked here
    cachedir.py     shard's cache folder, ``$XDG_CACHE_HOME/shard`` (no torch)
    tokenizer.py    tokenizer.json encode/decode and the model's chat template (no torch)
    chat_render.py  the chat template's bounded sandbox: every loop, call and value charged
    chat_bounds.py  what one render may spend (characters, steps, seconds) and its budget

This file imports nothing, so ``import shard.model.config`` stays torch-free.
"""
