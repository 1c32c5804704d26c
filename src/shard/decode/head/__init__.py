"""shard.decode.head: the feature-conditioned draft head at run time (EAGLE family) — it reads
the target's features and proposes the next tokens. Training it is offline work, in
``shard.training.head`` (``shard draft train``).

    model.py      ``DraftHead``: one Llama layer from (feature, next token) to the next
                  feature, read out through the target's head rows for a shortlist
    eagle3.py     ``Eagle3Head``: an EAGLE-3 head in its published layout (SpecForge's, which
                  vLLM and SGLang load): three target layers' states fused, one layer, a
                  draft vocabulary mapped back by ``d2t``
    eagle3_files.py  its ``config.json`` and ``model.safetensors``, read checked
                  (``Eagle3Config``, ``Eagle3Error``)
    eagle3_check.py  which target layers feed it, and the check that catches a head whose
                  layer indices are off by one (``check_layers``)
    mtp.py        ``MtpHead``: a checkpoint's own MTP block (DeepSeek-V3, GLM-4.5) read from
                  the target's files, fed the same final-norm features as ``DraftHead``
    shipped.py    heads shipped in the package (``shipped_heads/<name>/``, e.g.
                  ``smollm2-eagle3``), named in a spec by their directory's name
    proposer.py   ``HeadProposer`` (either head): ``observe`` features, ``propose`` (greedy) or
                  ``propose_sampled`` (draws from its own q and returns it)
"""
