"""Build the vLLM bridge's test environment of one minor: ``.venv-vllm/<minor>``.

``python tests/vllm/build_env.py 0.32`` (what ``make test`` runs, with the main
environment's Python) makes a fresh venv, installs ``plugins/vllm/v0_32/requirements-cpu.txt``
(a lock: ``--no-deps``, no resolution, no byte-compiling: Python compiles what the tests
import, once), attnplug itself (editable, ``--no-deps``), and runs ``pip check``, whose
complaints must be exactly ``pip-check-expected.txt`` of that minor.

attnplug is not built a second time either: when the running environment holds the editable
install of this very checkout, its few files (the ``.pth``, the editable finder, the
dist-info) are hard-linked as torch's are. The Cython extensions are built in place (next to
their ``.pyx``), so every environment imports the same ``.so`` files anyway; a second
``pip install -e`` only rebuilt them (about a minute per minor here). Otherwise (another
checkout, a plain install) ``pip install -e`` runs as before.

torch is not unpacked a second time: when the running (main) environment has the very
torch the lock pins, its files are hard-linked into the new venv (same wheel, same files,
no copy; ~900 MB otherwise unpacked again). Nothing else is shared: every other package,
torch's own dependencies included, is installed from the minor's lock, so the main
environment's pins (transformers 5.24) never reach vLLM's (<5.20). ``pip check`` in the new
venv proves that.

Exit status: 0 built; 1 a step failed or ``pip check`` differs (printed).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import sysconfig

REPO = pathlib.Path(__file__).resolve().parents[2]
SHARED = ("torch", "triton")
"""Distributions (torch and triton: the big ones) hard-linked from the running environment when the lock pins the same version."""


def pins(lock: pathlib.Path) -> dict[str, str]:
    """``{normalized name: version}`` of a ``name==version`` lock file."""
    out = {}
    for line in lock.read_text(encoding="utf-8").splitlines():
        m = re.match(r"^([A-Za-z0-9_.-]+)==(\S+)$", line.strip())
        if m:
            out[re.sub(r"[-_.]+", "-", m.group(1)).lower()] = m.group(2)
    return out


def installed(name: str) -> importlib.metadata.Distribution | None:
    """Distribution ``name`` in the running environment's site-packages (not an ``*.egg-info`` of the working directory)."""
    return next(iter(importlib.metadata.distributions(name=name, path=[sysconfig.get_paths()["purelib"]])), None)


def link_distribution(name: str, site: pathlib.Path) -> int:
    """Hard-link every file of installed distribution ``name`` under ``site``; returns the count."""
    dist = installed(name)
    here = pathlib.Path(sysconfig.get_paths()["purelib"])
    count = 0
    for rel in dist.files or ():
        if rel.parts[0] == ".." or rel.suffix == ".pyc":
            continue  # console scripts outside site-packages; bytecode is rebuilt
        src, dst = here / rel, site / rel
        if src.is_file():
            dst.parent.mkdir(parents=True, exist_ok=True)
            os.link(src, dst)
            count += 1
    return count


def editable_here() -> bool:
    """Whether the running environment's attnplug is the editable install of this checkout (``REPO``)."""
    dist = installed("attnplug")
    text = dist.read_text("direct_url.json") if dist else None
    if not text:
        return False
    info = json.loads(text)
    return bool(info.get("dir_info", {}).get("editable")) and info.get("url") == REPO.as_uri()


def run(*cmd: str) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def pip_check(python: str, expected: pathlib.Path) -> list[str]:
    """Lines of ``pip check`` that differ from ``expected`` (``+`` unexpected, ``-`` missing)."""
    proc = subprocess.run([python, "-m", "pip", "check"], capture_output=True, text=True)
    got = {ln.strip() for ln in proc.stdout.splitlines() if ln.strip() and "No broken requirements" not in ln}
    want = {ln.strip() for ln in expected.read_text(encoding="utf-8").splitlines() if ln.strip()} \
        if expected.exists() else set()
    return [f"+ {ln}" for ln in sorted(got - want)] + [f"- {ln}" for ln in sorted(want - got)]


def build(minor: str, root: pathlib.Path) -> int:
    folder = REPO / "plugins" / "vllm" / f"v{minor.replace('.', '_')}"
    lock = folder / "requirements-cpu.txt"
    if not lock.exists():
        print(f"build_env: no {lock.relative_to(REPO)} (supported minors: folders plugins/vllm/v0_*)")
        return 1
    env = root / minor
    shutil.rmtree(env, ignore_errors=True)
    run(sys.executable, "-m", "venv", str(env))  # based on the base interpreter, not on this venv
    python = str(env / "bin" / "python")
    site = pathlib.Path(subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                       capture_output=True, text=True, check=True).stdout.strip())
    locked = pins(lock)
    for name in SHARED:
        try:
            mine = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        if locked.get(name) == mine:
            print(f"build_env: {name} {mine}: {link_distribution(name, site)} files hard-linked from {sys.prefix}")
    run(python, "-m", "pip", "install", "-q", "--no-deps", "--no-compile", "-r", str(lock))
    if editable_here():
        print(f"build_env: attnplug (editable, {REPO}): {link_distribution('attnplug', site)} files hard-linked "
              f"from {sys.prefix}")
    else:
        run(python, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "-e", str(REPO))
    diff = pip_check(python, folder / "pip-check-expected.txt")
    if diff:
        print(f"build_env: pip check in {env} differs from {folder.name}/pip-check-expected.txt:\n  "
              + "\n  ".join(diff))
        return 1
    print(f"build_env: {env} ready (pip check as expected)")
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: build_env.py MINOR   (e.g. 0.32; run with the main environment's python)")
    sys.exit(build(sys.argv[1], REPO / ".venv-vllm"))
