"""`make bench`: every benchmark in turn, each printing its own table (see bench/RESULTS.md for recorded runs).

Benchmarks are never timed asserts in tests; this only runs them. The feedback benchmark needs `wrk`
(Debian package; the Makefile installs it when missing).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
BENCHMARKS = [
    ("serving gateway overhead", ["serving_latency.py", "-n", "100"]),
    ("feedback ingest under load", ["feedback_load.py", "--duration", "8"]),
    ("trainer machinery overhead", ["trainer_throughput.py", "--model", "tiny", "--steps", "30"]),
    ("rollout decision quality", ["rollout_decisions.py", "--runs", "200"]),
]


def main() -> int:
    failed = []
    for title, argv in BENCHMARKS:
        print(f"\n=== {title}: {' '.join(argv)}", flush=True)
        rc = subprocess.call([sys.executable, str(HERE / argv[0]), *argv[1:]])
        if rc != 0:
            failed.append(title)
    if failed:
        print(f"\nfailed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
