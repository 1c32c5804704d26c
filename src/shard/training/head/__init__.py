"""shard.training.head: ``shard draft train`` — the draft head (``shard.decode.head``) trained
offline on the target's own text, in minutes on a CPU.

    train.py      the loss, the shortlist, the target's greedy labels
    features.py   ``FeatureStore``: target-labelled text made once, in chunks, on disk
    trainer.py    ``Trainer``: the resumable training loop and its checkpoints
    measure.py    chained acceptance on held-out prompts and cost per drafted token
    build.py      ``train_head``: features, train, measure, publish
    cache.py      where heads live; ``resolve_head("smollm2-head")``

The command, ``shard draft train``, is ``shard.cli.draft``.
"""
