"""Regenerate the Python code for the `.proto` files: `python -P -m meridian.api.generate`.

protoc names modules after the proto path (`meridian/v1/inference.proto` -> `meridian.v1`), but the
code lives in the `meridian.api.v1` package, so the generated gRPC module's import is rewritten.
Needs grpcio-tools (a dev dependency); the committed output keeps it out of the runtime.
"""

import sys
import tempfile
from pathlib import Path

API_DIR = Path(__file__).resolve().parent
PROTOS = ["meridian/v1/inference.proto"]
PACKAGE_DIR = API_DIR / "v1"


def generate(out_dir: Path) -> list[Path]:
    """Write the generated modules for every proto into out_dir; returns their paths."""
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory() as raw:
        args = [
            "protoc",
            f"-I{API_DIR}",
            f"--python_out={raw}",
            f"--pyi_out={raw}",
            f"--grpc_python_out={raw}",
            *PROTOS,
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed: {' '.join(args)}")
        written = []
        for path in sorted((Path(raw) / "meridian" / "v1").iterdir()):
            text = path.read_text().replace(
                "from meridian.v1 import", "from meridian.api.v1 import"
            )
            target = out_dir / path.name
            target.write_text(text)
            written.append(target)
    return written


def main() -> int:
    for path in generate(PACKAGE_DIR):
        print(path.relative_to(API_DIR.parent), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
