"""Write crds/onlinerljob.yaml from the pydantic models (`--check` fails if the committed file is stale)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from onlinerl_operator.crdgen import render_yaml

CRD_PATH = Path(__file__).resolve().parent.parent / "crds" / "onlinerljob.yaml"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="exit 1 if the file differs from the models")
    args = parser.parse_args()
    text = render_yaml()
    if args.check:
        if not CRD_PATH.is_file() or CRD_PATH.read_text() != text:
            print(f"{CRD_PATH} is stale: run python tools/gen_crd.py", file=sys.stderr)
            return 1
        return 0
    CRD_PATH.write_text(text)
    print(f"wrote {CRD_PATH}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
