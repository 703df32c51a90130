"""`python -m onlinerl_operator [run]`: the operator; `python -m onlinerl_operator render -f JOB.yaml`: the offline
dry run. The command line lives in cli.py."""

from __future__ import annotations

import sys

from onlinerl_operator.cli import main

if __name__ == "__main__":
    sys.exit(main())
