"""shard.audit: spot checks — proof that a stage computed what it signed, by recomputing sampled
chunks of its block on another node holding the same block.

    compare.py         the pure core: the seed commitment, which chunks are audited, and how
                       a recomputation is compared with a claim (bit-exact, or the calibrated
                       cosine of a sketch where batching or dtypes differ)
    sampler.py         one audited stage of one session: the chains of its inputs and outputs,
                       the chunks picked, the requests made
    auditor.py         the auditing node's side: replays a chunk on its own copy of the block,
                       with the accused's kernels, and answers a verdict
    hub.py             ``AuditHub``: the scheduler's side — per-session seeds, one sampler per
                       audited stage, fed from the neighbours' copies of ring chunks
    checker.py         ``SpotChecker``: the spot checks as an actor beside the scheduler — copies
                       and verdicts in, requests, notes and evictions out, on channels
    strikes.py         failed audits counted per node, up to eviction
    hold.py            hold mode: tokens released only once every stage's part is confirmed
    evidence.py        signed, self-contained evidence of a failed audit, and its offline check
    evidence_files.py  each strike's evidence written to a file an operator can verify

It imports trust (keys, receipts), the decode cores, the model, ``shard.compute`` and messages;
never nodes, coordinator, failover or the network. The spot checker owns the hub; the
coordinator's root (``shard.nodes.coordinator``) wires it to the scheduler, and the stage
roots (``shard.nodes.auditing``) wire auditors.
"""
