"""What one rank holds, and how much of it fits where.

`config` turns config.json into mlx-lm's ModelArgs; `plan` gives each rank its
contiguous layer range (even or `--split`); `sizes` counts each layer's bytes
(weights and KV cache) and `plan` also splits layers over hosts in proportion to
their memory (`memory`: what a host may use, --memory-limit, how many sequences fit),
for ranks at start-up and the launcher alike; `stage` is the module a rank runs (mlx-lm's afmoe layers);
`loader` (with `hub` for downloads) loads only this rank's tensors;
`tiny_checkpoint` writes deterministic tiny checkpoints in both layouts (for tests)
and finds the embedded default model (`tiny_model/`, package data).
"""
