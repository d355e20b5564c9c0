"""Starting rings on top of distributed/: `trinity-launch plan|run|doctor` (`python -m launch`).

`cli` plans a split (distributed.shard's memory plan, with exact tensor sizes from
`checkpoint`; `bundled` finds the presets and example hostfiles of configs/ by name)
and starts the ranks: `hostfile` validates mlx.launch's hostfile formats, `runner` picks how, `ring` starts local ranks directly, `ssh_ring` remote
ones over ssh, `mlx_launch_ring` goes through mlx.launch (other backends) and reads
which rank failed; `processes` finds and signals what a ring started, `supervisor`
watches a ring, tears it down without orphans and restarts it (--restart); `guard`
wraps MPI ranks so their exits are reported. `doctor` checks every host before a ring starts
(`probes` runs `host_probe` on each, `checks` judges what they found) and measures the links
with a ring of `link_probe`; `links` keeps them for `tensor_plan`'s speed model. Nothing under
distributed/ imports launch.
"""
