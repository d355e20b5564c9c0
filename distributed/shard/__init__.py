"""What one rank holds, and how much of it fits where.

`config` turns config.json into mlx-lm's ModelArgs (`checkpoint`: a checkpoint's config and
tensor sizes without loading it); `plan` gives each rank its contiguous layer range (even,
`--split`, or in proportion to memory, for ranks at start-up and the launcher alike); `sizes`
counts each layer's bytes (weights and KV cache) and `memory` what a rank has (--memory-limit)
and how many sequences fit in it; `stage` is the module a rank runs (mlx-lm's afmoe layers),
`tensor` its layers sharded over a tensor group; `loader` (with `hub` for downloads) loads only
this rank's tensors, `draft` the draft model; `tiny_checkpoint` writes deterministic tiny
checkpoints in both layouts (for tests) and finds the embedded default model (`tiny_model/`,
`tiny_draft/`, package data).
"""
