"""The package layout is the architecture (docs/architecture.md, "How it is built"): every import,
lazy ones inside functions included, points down the layers; no module imports
itself back through others; no function grows past a screen.

Layers, bottom to top: the `distributed` package's own __init__ (TrinityError);
transport/ and shard/; runtime/; startup/ and serving/ (side by side, neither
imports the other); run-trinity's command line (command_line.py) and the client (client.py); the
rank's main (cli.py); launch/.
"""

import ast
from pathlib import Path
from typing import Dict, Set

from conftest import ROOT

LAYERS = {
    "distributed": 0,
    "distributed.transport": 1,
    "distributed.shard": 1,
    "distributed.runtime": 2,
    "distributed.startup": 3,
    "distributed.serving": 3,
    "distributed.command_line": 4,
    "distributed.client": 4,
    "distributed.cli": 5,
    "launch": 6,
}
MAX_FUNCTION_LINES = 80


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> Dict[str, Path]:
    return {module_name(p): p for top in ("distributed", "launch") for p in (ROOT / top).rglob("*.py")}


def imports(name: str, path: Path, known: Set[str]) -> Set[str]:
    """Our modules that `name` imports, anywhere in its body (`from a import b` counts
    a.b when b is a module, else a)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for a in node.names:
                found.add(f"{source}.{a.name}" if f"{source}.{a.name}" in known else source)
    return {m for m in found if m in known and m != name}


def layer_of(name: str) -> str:
    """The longest LAYERS key that is `name` or a package above it."""
    return max((k for k in LAYERS if name == k or name.startswith(k + ".")), key=len)


def import_graph() -> Dict[str, Set[str]]:
    mods = modules()
    return {name: imports(name, path, set(mods)) for name, path in mods.items()}


def test_every_import_points_down_the_layers():
    upward = []
    for name, targets in import_graph().items():
        own = layer_of(name)
        for target in targets:
            other = layer_of(target)
            if other != own and LAYERS[other] >= LAYERS[own]:
                upward.append(f"{name} imports {target} ({own} may not import {other})")
    assert not upward, "\n".join(sorted(upward))


def test_no_import_cycles():
    graph = import_graph()
    cycles, done = [], set()

    def visit(name, path):
        if name in path:
            cycles.append(" -> ".join(path[path.index(name):] + [name]))
            return
        if name in done:
            return
        for target in sorted(graph[name]):
            visit(target, path + [name])
        done.add(name)

    for name in sorted(graph):
        visit(name, [])
    assert not cycles, "\n".join(cycles)


def test_layer_map_names_every_package():
    """A new package must be placed in a layer, not fall into its parent's by accident."""
    packages = {module_name(p.parent / "__init__.py") for p in ROOT.glob("distributed/*/__init__.py")}
    packages -= {"distributed.serving.proto"}  # generated code, part of serving
    assert packages <= set(LAYERS), sorted(packages - set(LAYERS))


def test_functions_fit_a_screen():
    """A module is one idea, whatever its length; a function fits a screen (MAX_FUNCTION_LINES)."""
    long = []
    for top in ("distributed", "launch", "run_trinity.py"):
        for path in [ROOT / top] if top.endswith(".py") else (ROOT / top).rglob("*.py"):
            if path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
                continue  # generated
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    n = node.end_lineno - node.lineno + 1
                    if n > MAX_FUNCTION_LINES:
                        long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {n} lines")
    assert not long, "\n".join(long)


def test_the_launcher_starts_without_mlx_lm():
    # mlx_lm (and the transformers it imports) take about a second of CPU to import; a launcher
    # that does not plan from a checkpoint or serve (--no-plan --no-router) never needs them.
    import subprocess
    import sys

    code = ("import sys, launch.cli, launch.runner, launch.supervisor, launch.replan, launch.ssh_ring\n"
            "print(sorted(m for m in ('mlx_lm', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True).stdout
    assert out.strip() == "[]", out
