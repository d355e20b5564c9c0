"""Planning a split across unequal hosts, checking hostfiles, starting ranks.

`sizes` turns config.json (or a checkpoint's exact tensor sizes) into bytes per
layer, `plan` splits layers over hosts by memory (and speed), `hostfile`
validates mlx.launch's hostfile formats, `memory` measures and exchanges each
rank's usable memory, `runner` builds and runs the mlx.launch command, `cli` is
`python -m launch plan|run`.
"""
