"""A rank's start-up and its control channel: who it is and how it stays in the ring.

`preflight` checks the launch environment and ports before joining; `join` runs
mx.distributed.init under a watchdog, plans the split (`auto_split` with
`--split auto`), agrees with the other ranks (`handshake`: same checkpoint, memory,
control address), loads this rank's slice and builds its side of the runtime.
`watchdog` keeps heartbeats beside mx.distributed on a plain TCP channel
(`control_link`), so a dead peer becomes a clean error; stop requests and parking
ride the same channel. `lifecycle` is how a rank process ends.
"""
