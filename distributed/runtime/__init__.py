"""The ring runtime: what runs on the ring once every rank has joined and loaded.

`pipeline` is each rank's part: rank 0 drives the ring (sends frames without waiting, replies in
order), every other rank serves it (receive, run the stage, pass on), and each counts its own work;
`tensor` is the same with each stage's layers sharded over a group (--tensor-parallel-size).
`scheduler` is the one place that decides what runs next: a bounded queue, admission, and
`batching`: continuous batching of running requests with batched prefill of waiting prompts (the
frames it has in the ring: `frames`). A running request is a `sequence` (sampling, logits
processors, top and prompt logprobs, stop strings, events) of a `request` (what a client asks for
and the events it gets back); `grammar` constrains what it samples; `speculation` verifies drafts
(prompt lookup, or `draft_model`) in one frame. `caches` holds a rank's KV caches by slot,
`prefix_cache` keeps them across requests, `memory_guard` holds frames and admission to the
memory a rank has, and `rank_info` is what each rank reports about itself. The runtime knows
nothing of gRPC, HTTP or launchers.
"""
