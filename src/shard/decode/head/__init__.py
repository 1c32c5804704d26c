"""shard.decode.head: the feature-conditioned draft head at run time (EAGLE family) — it reads
the target's features and proposes the next tokens. Training it is offline work, in
``shard.training.head`` (``shard draft train``).

    model.py      ``DraftHead``: one Llama layer from (feature, next token) to the next
                  feature, read out through the target's head rows for a shortlist
    proposer.py   ``HeadProposer``: ``observe`` features, ``propose`` (greedy) or
                  ``propose_sampled`` (draws from its own q and returns it)
"""
