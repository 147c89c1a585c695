"""Build the Python code for ``protos/*.proto``: ``python -m pagefleet.protos.build``.

Runs ``grpc_tools.protoc`` (the installed grpcio-tools, so the generated code matches
the installed protobuf runtime) and rewrites the generated imports to live under
``pagefleet.protos``. The output is committed; ``--check`` regenerates into a
temporary folder and exits 1 if anything differs (CI runs it via the tests).
"""

from __future__ import annotations

import argparse
import filecmp
import re
import sys
import tempfile
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent
SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")
_IMPORT = re.compile(r"^import (\w+_pb2)( as \w+)?$", re.MULTILINE)


def generate(out_dir: Path) -> list[Path]:
    """Generate every ``*.proto`` into ``out_dir``; the files written."""
    import grpc_tools
    from grpc_tools import protoc

    protos = sorted(p.name for p in PROTO_DIR.glob("*.proto"))
    include = str(Path(grpc_tools.__file__).parent / "_proto")
    args = [
        "protoc",
        f"-I{PROTO_DIR}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *protos,
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    written = []
    for path in sorted(out_dir.iterdir()):
        if path.name.endswith(SUFFIXES):
            text = _IMPORT.sub(r"from pagefleet.protos import \1\2", path.read_text())
            path.write_text(text)
            written.append(path)
    return written


def check() -> list[str]:
    """Names of generated files that differ from a fresh build (empty: up to date)."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
        stale = [f.name for f in fresh if not (PROTO_DIR / f.name).is_file()
                 or not filecmp.cmp(f, PROTO_DIR / f.name, shallow=False)]
        names = {f.name for f in fresh}
        stale += [p.name for p in PROTO_DIR.iterdir() if p.name.endswith(SUFFIXES) and p.name not in names]
    return stale


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pagefleet.protos.build", description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail if the committed code is stale")
    args = parser.parse_args(argv)
    if args.check:
        stale = check()
        if stale:
            print(f"generated code is stale: {', '.join(stale)}; run python -m pagefleet.protos.build",
                  file=sys.stderr)
            return 1
        return 0
    for path in generate(PROTO_DIR):
        print(path.relative_to(PROTO_DIR.parent))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
