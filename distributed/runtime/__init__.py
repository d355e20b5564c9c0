"""The ring runtime: what runs on the ring once every rank has joined and loaded.

Rank 0 drives the ring (`pipeline`: sends frames without waiting, replies in
order); every other rank serves it (`worker`: receive, run the stage, pass on).
`scheduler` is the one place that decides what runs next: a bounded queue,
admission, batched prefill of waiting prompts (`prefill`), continuous batching
(`batching`) of running requests (`sequence`: sampling, stop strings, events; `logits`: logits processors, top and prompt logprobs;
`request`: what a client asks for and the events it gets back). `caches` holds a rank's KV caches by slot; `rank_info` is what each
rank reports about itself. The runtime knows nothing of gRPC, HTTP or launchers.
"""
