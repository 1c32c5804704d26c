"""shard.training.eagle3: training an EAGLE-3 head in its published layout
(``shard.decode.head.eagle3``) for a target this machine runs (``shard draft eagle3``).

    prompts.py    varied training prompts: templates over the tokenizer's own whole words
    copy_prompts.py  copy tasks: passages of those words to repeat, or to go on copying
    data.py       the target's continuations with the states entering the head's three
                  layers (``sample_batch``), cached in chunks (``ChunkStore``, ``fill``)
    train.py      the training-time test: the unrolled forward (``unrolled``) and its loss
    build.py      a new head started from the target's head rows, the training loop, and
                  the files in SpecForge's layout (``save_head``)
    run.py        ``build_eagle3``: all of it, end to end (measured with the feature
                  head's ``shard.training.head.measure.chained_acceptance``)
"""
