"""Print the repo's source files a build runs, one per line (``python -m bench.builds.build_sources``): the list
``compiler/code_key.py`` makes in a fresh interpreter (every module ``compiler.build`` and ``compiler.draft``
import), whose hash is the build cache key (``compiler_key``) of the tests, the benches and the coordinator.
Kept as this entry point; the code is in compiler/code_key.py."""

from __future__ import annotations

from compiler.code_key import build_sources

if __name__ == "__main__":
    print("\n".join(build_sources()))
