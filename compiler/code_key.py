"""The compiler's code key: a short hash of the source files a build runs and of the wire protocol version, so
that a cached build is made again when either changes. The one definition: the tests' and benches' build caches
(bench/harness.py ``compiler_key``) and the coordinator's (coordinator/fleet/planned.py ``build_key``) call it.

The files are every module of fleet's own packages that ``compiler.build`` and ``compiler.draft`` import, at
module level and inside functions (their import statements, followed until no new module turns up), listed
by ``python -m compiler.code_key`` in a fresh interpreter (this process may have imported anything)."""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the folder holding fleet's packages (a checkout, or site-packages)
PACKAGES = ("compiler", "fleet_common", "worker", "coordinator")  # fleet's own code; bench/ and tests/ are not
LIST_TIMEOUT_S = 120.0


def ours() -> dict[str, Path]:
    """Imported modules of fleet's own packages under ``ROOT`` (not this script as ``__main__``): name -> file."""
    files = {n: Path(m.__file__).resolve() for n, m in list(sys.modules.items())
             if getattr(m, "__file__", None) and n not in ("__main__", "__mp_main__")}
    return {n: f for n, f in files.items() if f.is_relative_to(ROOT) and f.relative_to(ROOT).parts[0] in PACKAGES}


def imported_names(name: str, path: Path) -> list[str]:
    """Every module name an import statement anywhere in ``path`` (module ``name``) may load."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = importlib.util.resolve_name("." * node.level + (node.module or ""), package) if node.level \
                else node.module
            names += [base, *(f"{base}.{a.name}" for a in node.names)]  # from package import submodule
    return names


def list_build_sources() -> list[str]:
    """The files (relative to ``ROOT``) of the modules a build imports, sorted. Imports them into this
    process: run it in a fresh interpreter (``build_sources``)."""
    import compiler.build  # noqa: F401
    import compiler.draft  # noqa: F401

    seen: dict[str, Path] = {}
    while len(ours()) > len(seen):
        seen = ours()
        packages = {n.split(".")[0] for n in seen}
        for name, path in seen.items():
            for target in imported_names(name, path):
                if target.split(".")[0] in packages:
                    try:
                        importlib.import_module(target)
                    except ImportError:
                        pass  # a name imported from a module, not a submodule
    return sorted({str(f.relative_to(ROOT)) for f in seen.values()})


@functools.cache
def build_sources() -> tuple[str, ...]:
    """``list_build_sources`` run in a fresh interpreter on this code (``ROOT`` first on PYTHONPATH). Raises
    ``subprocess.CalledProcessError`` / ``TimeoutExpired`` (after ``LIST_TIMEOUT_S``) when it fails."""
    path = os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))
    out = subprocess.run([sys.executable, "-m", "compiler.code_key"], cwd=ROOT, env={**os.environ, "PYTHONPATH": path},
                         capture_output=True, text=True, timeout=LIST_TIMEOUT_S, check=True)
    return tuple(out.stdout.split())


@functools.cache
def compiler_key() -> str:
    """10 hex of sha256 over the wire protocol version and each of ``build_sources``' path and bytes."""
    from fleet_common import PROTOCOL_VERSION

    digest = hashlib.sha256(f"protocol {PROTOCOL_VERSION}".encode())
    for path in build_sources():
        digest.update(path.encode() + b"\0" + (ROOT / path).read_bytes())
    return digest.hexdigest()[:10]


if __name__ == "__main__":
    print("\n".join(list_build_sources()))
