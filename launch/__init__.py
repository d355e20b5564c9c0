"""Planning a split across unequal hosts, checking hostfiles, starting ranks.

`sizes` turns config.json (or a checkpoint's exact tensor sizes) into bytes per
layer, `plan` splits layers over hosts by memory (and speed), `hostfile`
validates mlx.launch's hostfile formats, `memory` measures and exchanges each
rank's usable memory, `runner` builds the mlx.launch command, `ring` starts a ring
(local ranks directly, others through mlx.launch), `processes` finds and signals
what a ring started, `supervisor` watches a ring, tears it down without orphans and
restarts it after a failure (--restart), `cli` is `python -m launch plan|run`.
"""
