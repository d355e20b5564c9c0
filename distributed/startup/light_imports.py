"""A rank imports mlx-lm's model code without mlx-lm's package __init__.

`mlx_lm/__init__.py` imports its converter and generator, and with them transformers: about a
CPU-second a process (0.9 of the 1.4 s `import distributed.cli` took on a 2-core machine). Ranks
other than 0 never tokenize, so run_trinity.py registers the package without running its
__init__: submodules (`mlx_lm.models.afmoe`, `mlx_lm.utils`) import as usual, and the first
attribute read from the package itself (`mlx_lm.load`, `from mlx_lm import generate`) runs the real
__init__ then. Rank 0 imports transformers when it loads the tokenizer, as before.
"""

import importlib.util
import os
import sys


def defer_package_init(name: str = "mlx_lm") -> None:
    """Register package `name` in sys.modules; its __init__ runs on the first attribute it lacks."""
    if name in sys.modules:
        return
    spec = importlib.util.find_spec(name)
    package = importlib.util.module_from_spec(spec)

    def run_init(attribute: str):
        del package.__getattr__
        spec.loader.exec_module(package)
        return getattr(package, attribute)

    package.__getattr__ = run_init
    sys.modules[name] = package
    # What mlx_lm's __init__ sets before its modules import transformers.
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
