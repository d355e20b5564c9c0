"""python -m bench SUBCOMMAND [flags]: every benchmark of this checkout, one entry, one set of flag
names (bench/harness.py), one results format (JSON headed by the machine, the commit and the date)."""

import argparse
import importlib
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Subcommand -> module of bench/ (each has add_arguments(parser) and main(args)).
SUBCOMMANDS = {
    "decode": "decode", "load": "load", "speculation": "speculation", "soak": "soak", "micro": "micro",
    "prefill-limit": "prefill_limit", "tensor": "tensor", "tensor-model": "tensor_model",
    "strict-tools": "strict_tools", "request-path": "request_path",
    "prefix-cache": "prefix_cache", "prefill-stages": "prefill_stages", "agents": "agents", "stalls": "stalls", "admission": "admission",
}


def add_subcommands(parser: argparse.ArgumentParser, modules: dict, package: str = "bench") -> None:
    subs = parser.add_subparsers(dest="subcommand", required=True, metavar="SUBCOMMAND")
    for name, module in modules.items():
        m = importlib.import_module(f"{package}.{module}")
        sub = subs.add_parser(name, help=" ".join(m.__doc__.split("\n\n")[0].split()), description=m.__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
        m.add_arguments(sub)
        sub.set_defaults(parser=sub)  # its defaults, for --smoke (harness.shrink)
        if hasattr(m, "main"):
            sub.set_defaults(run=m.main)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    add_subcommands(parser, SUBCOMMANDS)
    return parser


def main(argv=None):
    if str(ROOT) not in sys.path:  # the distributed and launch packages of this checkout
        sys.path.insert(0, str(ROOT))
    args = build_parser().parse_args(argv)
    from distributed import logs  # progress and diagnostics on stderr, as every process of the project

    logs.configure("info")
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
