"""Starting rings on top of distributed/: `trinity-launch plan|run` (`python -m launch`).

`cli` plans a split (distributed.shard's memory plan, with exact tensor sizes from
`checkpoint`; `bundled` finds the presets and example hostfiles of configs/ by name)
and starts the ranks: `hostfile` validates mlx.launch's hostfile formats, `runner` picks how, `ring` starts local ranks directly, `ssh_ring` remote
ones over ssh, `mlx_launch_ring` goes through mlx.launch (other backends) and reads
which rank failed; `processes` finds and signals what a ring started, `supervisor`
watches a ring, tears it down without orphans and restarts it (--restart); `guard`
wraps MPI ranks so their exits are reported. Nothing under distributed/ imports launch.
"""
