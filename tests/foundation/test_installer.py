"""``make setup``'s installer (tools/installer.py): uv under pip's settings, and pip when uv is not there.

The real case runs both tools against a fresh venv and a wheel that only a pip setting can find: a local
``find-links`` folder with ``no-index``, given through ``PIP_CONFIG_FILE`` as our machines give theirs.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tools import installer

UV = Path(sys.executable).parent / "uv"


def test_the_setting_pip_would_use_wins() -> None:
    listing = "\n".join(
        [
            "global.find-links='/global/wheels'",
            "install.find-links='/install/wheels'",
            "global.extra-index-url='file:///a/simple file:///b/simple'",
            "global.constraint='/global/constraints.txt'",
            ":env:.constraint='/env/constraints.txt'",
            "download.dest='/elsewhere'",
            ":env:.default-timeout='180'",
            "global.cert='/etc/ssl/certs/ca.crt'",
            "global.no-index='true'",
            "global.pre='true'",
            "not a setting",
        ]
    )
    settings = installer.pip_settings(listing)
    assert settings["find-links"] == "/install/wheels", "[install] overrides [global]"
    assert settings["constraint"] == "/env/constraints.txt", "PIP_CONSTRAINT overrides every file"
    assert "dest" not in settings, "another command's section is not pip install's"

    flags, env, dropped = installer.uv_options(settings)
    assert flags[:2] == ["--index-strategy", "unsafe-best-match"], "the best version from any index, as pip takes it"
    pairs = list(zip(flags[2::2], flags[3::2], strict=False))
    assert ("--extra-index-url", "file:///a/simple") in pairs and ("--extra-index-url", "file:///b/simple") in pairs
    assert ("--find-links", "/install/wheels") in pairs and ("--constraint", "/env/constraints.txt") in pairs
    assert "--no-index" in flags
    assert env == {"UV_HTTP_TIMEOUT": "180", "SSL_CERT_FILE": "/etc/ssl/certs/ca.crt"}
    assert dropped == ["pre"], "a setting uv is not told about is named, not silently lost"


def _probe_wheel(folder: Path, version: str) -> Path:
    """A minimal pure-Python wheel that no index holds: only the find-links setting can find it."""
    name = "onlinerl_installer_probe"
    dist_info = f"{name}-{version}.dist-info"
    files = {
        f"{name}.py": f"VERSION = {version!r}\n",
        f"{dist_info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{dist_info}/WHEEL": "Wheel-Version: 1.0\nGenerator: hand\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    files[f"{dist_info}/RECORD"] = "".join(f"{path},,\n" for path in files) + f"{dist_info}/RECORD,,\n"
    path = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as wheel:
        for arcname, text in files.items():
            wheel.writestr(arcname, text)
    return path


@pytest.mark.skipif(not UV.is_file(), reason="uv is not installed beside this Python (make setup installs it)")
def test_uv_and_pip_each_install_under_pips_settings_and_uninstall(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _probe_wheel(wheels, "1.0")
    config = tmp_path / "pip.conf"
    config.write_text(f"[global]\nno-index = true\nfind-links = {wheels}\n")
    venv = tmp_path / "venv"
    # no pip of its own (ensurepip is 4 s): the base interpreter's pip serves it, and installs into it
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", str(venv)], check=True)
    python = venv / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "UV_"))}
    env |= {"PIP_CONFIG_FILE": str(config), "UV_CACHE_DIR": str(tmp_path / "uv-cache")}

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(python), str(installer.__file__), *args], env=env, capture_output=True, text=True, timeout=120
        )

    def version() -> str:
        code = "import onlinerl_installer_probe as p; print(p.VERSION)"
        return subprocess.run([str(python), "-c", code], capture_output=True, text=True).stdout.strip()

    # uv beside the venv's Python: it installs from the find-links folder only pip's config names, and compiles it
    (venv / "bin" / "uv").symlink_to(UV)
    done = run("install", "onlinerl_installer_probe==1.0")
    assert done.returncode == 0, done.stderr
    assert "trying pip" not in done.stderr and version() == "1.0"
    assert list((venv / "lib").glob("python3.*/site-packages/__pycache__/onlinerl_installer_probe.*.pyc"))
    assert run("uninstall", "onlinerl_installer_probe", "not-installed-anywhere").returncode == 0
    assert version() == ""

    # no uv: pip does the same, from the same settings
    (venv / "bin" / "uv").unlink()
    _probe_wheel(wheels, "2.0")
    done = run("install", "onlinerl_installer_probe==2.0")
    assert done.returncode == 0, done.stderr
    assert "pip install (slower)" in done.stderr and version() == "2.0"

    # a version nobody has fails loudly, through both tools
    (venv / "bin" / "uv").symlink_to(UV)
    failed = run("install", "onlinerl_installer_probe==3.0")
    assert failed.returncode != 0 and "trying pip" in failed.stderr


def test_a_call_without_an_action_is_refused() -> None:
    assert installer.main([]) == 2
    assert installer.main(["freeze"]) == 2
