"""shard.convert: GGUF checkpoints turned into the model runtime's safetensors checkpoints, and
models found by name or path. It sits beside ``shard.model``, not in it, as gpt-fast keeps its
converters beside the model: the runtime loads only safetensors and imports nothing here; the
CLI (``shard convert``, and every command that takes a model), the composition roots, the
draft training and ``shard bench`` find and convert models through it.

    bundled.py      find a model by name or path (the shipped SmolLM2 and Gemma 3 270M),
                    converting a GGUF once into the cache
    gguf_import.py  GGUF -> safetensors checkpoint conversion (``convert_gguf``)
    gguf_scan.py    the bounded read of a GGUF header (input from strangers)
    gguf_file.py    a scanned GGUF: its metadata and its tensors mapped read-only
    gguf_tensors.py the tensors an architecture needs, their types and shapes
    gguf_arch.py    what differs between GGUF architectures: names, config keys, conventions
    gguf_common.py  what every GGUF architecture's reader shares (error, metadata, GgufArch)
    gguf_moe.py     the GGUF architectures with experts: Qwen3-MoE, Mixtral, gpt-oss, GLM-4.5,
                    MiniMax-M2
    gguf_mla.py     llama.cpp's deepseek2 (DeepSeek-V3's MLA, split kv_b joined back)
    gguf_next.py    llama.cpp's qwen3next (Qwen3-Next: A_log, in_proj_qkvz, conv1d put back)
    gguf_plan.py    a conversion's output tensors, experts split or re-fused
    gguf_vocab.py   a GGUF's tokenizer metadata -> tokenizer.json (for gguf_import)
    quant_gguf.py   GGUF quant blocks mapped exactly onto ``shard.model.quant``'s layouts, so
                    a converted checkpoint keeps them stored

Of shard it imports only ``shard.model.quant`` (the quantized layouts); nothing of the network.
"""
