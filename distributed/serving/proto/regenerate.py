"""Regenerate generation_pb2.py, generation_pb2.pyi and generation_pb2_grpc.py
from generation.proto (needs grpcio-tools: `pip install -e .[dev]`).

    python distributed/serving/proto/regenerate.py

The proto is compiled from the repository root, so it registers as
"distributed/serving/proto/generation.proto"; the generated stub's absolute import is
then made package-relative.
"""

import sys
from pathlib import Path

from grpc_tools import protoc

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
PROTO = "distributed/serving/proto/generation.proto"


def main() -> None:
    include = Path(protoc.__file__).parent / "_proto"
    args = ["protoc", f"-I{ROOT}", f"-I{include}", f"--python_out={ROOT}", f"--pyi_out={ROOT}",
            f"--grpc_python_out={ROOT}", str(ROOT / PROTO)]
    if protoc.main(args) != 0:
        sys.exit("protoc failed")
    stub = HERE / "generation_pb2_grpc.py"
    text = stub.read_text()
    absolute = "from distributed.serving.proto import generation_pb2 as"
    assert absolute in text, "unexpected import in the generated stub"
    text = text.replace(absolute, "from . import generation_pb2 as")
    if "warnings." not in text:  # an unused import (ruff F401) that grpcio-tools 1.85 writes
        text = text.replace('"""\nimport grpc\nimport warnings\n', '"""\n\nimport grpc\n')
    stub.write_text(text)
    print(f"regenerated {', '.join(p.name for p in sorted(HERE.glob('generation_pb2*')))}")


if __name__ == "__main__":
    main()
