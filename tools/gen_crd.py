"""Write the CRD from the pydantic models into crds/ and the chart's copy (`--check` fails if either is stale).

The chart renders its copy as a normal template (so `helm upgrade` upgrades the CRD); both files must be identical.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from onlinerl_operator.crdgen import render_yaml

ROOT = Path(__file__).resolve().parent.parent
CRD_PATH = ROOT / "crds" / "onlinerljob.yaml"
CHART_COPY = ROOT / "charts" / "onlinerl" / "files" / "crds" / "onlinerljob.yaml"
TARGETS = (CRD_PATH, CHART_COPY)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="exit 1 if the file differs from the models")
    args = parser.parse_args()
    text = render_yaml()
    if args.check:
        stale = [p for p in TARGETS if not p.is_file() or p.read_text() != text]
        for p in stale:
            print(f"{p} is stale: run python tools/gen_crd.py", file=sys.stderr)
        return 1 if stale else 0
    for p in TARGETS:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
        print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
