"""Print the repo's source files a build runs, one per line (``python -m bench.build_sources``): every
module ``compiler.build`` and ``compiler.draft`` import, at module level (``sys.modules`` after importing
them) and inside functions (their import statements, followed until no new module turns up). Run in a
fresh interpreter by ``bench.harness.build_sources``, whose build cache key (``compiler_key``, the tests'
and the benches') hashes these files."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def ours() -> dict[str, Path]:
    """Imported modules whose file is in the repo, not in its .venv, tests/ or bench/ (this script, also as
    ``__main__`` and ``__mp_main__``, and its package): name -> file."""
    files = {n: Path(m.__file__).resolve() for n, m in list(sys.modules.items()) if getattr(m, "__file__", None)}
    return {n: f for n, f in files.items()
            if f.is_relative_to(ROOT) and f.relative_to(ROOT).parts[0] not in (".venv", "tests", "bench")}


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


def build_sources() -> list[str]:
    """The files (relative to the repo) of the modules a build imports, sorted."""
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


if __name__ == "__main__":
    print("\n".join(build_sources()))
