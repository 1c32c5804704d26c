"""shard.decode.head: ``shard draft train`` — a draft head that reads the target's features
(EAGLE family), trained offline on the target's own text in minutes on a CPU.

    model.py      ``DraftHead``: one Llama layer from (feature, next token) to the next
                  feature, read out through the target's head rows for a shortlist
    proposer.py   ``HeadProposer``: ``observe`` features, ``propose`` (greedy) or
                  ``propose_sampled`` (draws from its own q and returns it)
    train.py      the loss, the shortlist, the target's greedy labels
    features.py   ``FeatureStore``: target-labelled text made once, in chunks, on disk
    trainer.py    ``Trainer``: the resumable training loop and its checkpoints
    measure.py    chained acceptance on held-out prompts and cost per drafted token
    build.py      ``train_head``: features, train, measure, publish
    cache.py      where heads live; ``resolve_head("smollm2-head")``
    cli.py        ``shard draft train``
"""
