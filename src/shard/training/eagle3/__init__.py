"""Training an EAGLE-3 head in its published layout (``shard.decode.head.eagle3``) for a
target this machine runs: the target's own text with the states entering three of its
layers (``data``), a training-time-test unrolled loss (``train``), and the SpecForge
layout written out (``publish``)."""
