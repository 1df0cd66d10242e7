"""What a bench's ``--model PATH`` names, and the fleet builds a bench makes of it (shared by the benches).

``--model`` accepts one of:

* a GGUF file (``.gguf``, or any file that starts with GGUF's magic): built with ``fleet-compiler build FILE
  --shards N -o DIR`` (its blocks kept) into the bench's cache, one build per stage count the bench needs;
* a Hugging Face model folder (``config.json`` + safetensors): built the same way (fp16);
* a fleet build (a folder holding ``manifest.json``): used as it is. It has one stage count: a bench asking
  for another is refused (:class:`ModelError`), rows that need another (a 1-stage baseline) are left out.

Without ``--model`` a bench runs the demo (SmolLM2-135M-Instruct: the tests' copy, else fetched into the cache).
Builds are made and cached by ``bench.harness.ensure_build``: a folder name carries a hash of the code a build
runs, of the source (its resolved path, and each file's size and mtime) and of the build options, so a changed
compiler or another source makes a new build. The builds carry their own tokenizer, so the benches' prompts work on
any model.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from bench import harness

MODEL_HELP = ("a GGUF file, a Hugging Face model folder (both built into --cache with fleet-compiler build) or a "
              "fleet build (a folder with manifest.json, used as it is); default: the demo, SmolLM2-135M-Instruct")


class ModelError(ValueError):
    """A ``--model`` that names nothing usable, or a build that does not have what the bench asks for."""


@dataclass(frozen=True)
class Model:
    """A resolved ``--model``: ``kind`` is ``gguf``, ``hf`` or ``build``; ``path`` the file or folder."""

    kind: str
    path: Path
    demo: bool = False

    @property
    def name(self) -> str:
        """A short name for tables, JSON and build folders: the GGUF's stem or the folder's name."""
        return self.path.stem if self.kind == "gguf" else self.path.name

    @property
    def stages(self) -> int | None:
        """A build folder's stage count (None for a source, which builds any count)."""
        return num_stages(self.path) if self.kind == "build" else None


def resolve(path: Path | str) -> Model:
    """Classify ``path`` (module docstring). Raises :class:`ModelError` saying what it is and what is accepted."""
    from compiler.gguf import is_gguf_file

    path = Path(path).expanduser()
    accepted = "give a .gguf file, a Hugging Face model folder (config.json) or a fleet build (manifest.json)"
    if path.is_dir():
        if (path / "manifest.json").is_file():
            return Model("build", path.resolve())
        if (path / "config.json").is_file():
            return Model("hf", path.resolve())
        raise ModelError(f"--model {path}: a folder with neither manifest.json nor config.json; {accepted}")
    if path.is_file():
        if is_gguf_file(path):
            return Model("gguf", path.resolve())
        raise ModelError(f"--model {path}: not a GGUF file (it does not start with b'GGUF'); {accepted}")
    raise ModelError(f"--model {path}: no such file or folder; {accepted}")


def model_arg(text: str) -> Model:
    """argparse ``type`` for ``--model``: :func:`resolve`, its error as argparse's usage error."""
    try:
        return resolve(text)
    except ModelError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--model ")) from None


def add_model_option(parser: argparse.ArgumentParser) -> None:
    """The benches' ``--model PATH`` option (a :class:`Model`, or None for the demo)."""
    parser.add_argument("--model", type=model_arg, metavar="PATH", help=MODEL_HELP)


def from_args(model: Model | None, cache: Path, demo_folder: Path | None = None) -> Model:
    """``model``, or the demo's HF folder (``harness.demo_hf``: ``demo_folder``, the tests' copy or one
    fetched into ``cache``)."""
    if model is not None:
        return model
    return Model("hf", harness.demo_hf(demo_folder, cache), demo=True)


def require_gguf(model: Model, why: str) -> Path:
    """The GGUF file ``model`` names; :class:`ModelError` (naming ``why``) for an HF folder or a build."""
    if model.kind != "gguf":
        what = "a fleet build" if model.kind == "build" else "a Hugging Face folder"
        raise ModelError(f"{why} needs --model to be a GGUF file (llama.cpp runs GGUFs; the fleet is built from the "
                         f"same file), and {model.path} is {what}")
    return model.path


def num_stages(build: Path) -> int:
    """The stage count in ``build``'s manifest.json."""
    from fleet_common.manifest import load_manifest

    return load_manifest(build).manifest.num_stages


def architecture(build: Path):  # noqa: ANN201 - fleet_common.manifest.Architecture
    """The model's dimensions from ``build``'s manifest.json (vocab_size, hidden_size, num_layers, ...)."""
    from fleet_common.manifest import load_manifest

    return load_manifest(build).manifest.architecture


def check_build(build: Path, stages: int, drafts: tuple[str, ...] = ()) -> None:
    """Raise :class:`ModelError` unless fleet build ``build`` has ``stages`` stages and every one of ``drafts``."""
    from fleet_common.manifest import load_manifest

    manifest = load_manifest(build).manifest
    if manifest.num_stages != stages:
        raise ModelError(f"--model {build} is a fleet build of {manifest.num_stages} stage(s), and this bench asks "
                         f"for {stages}: give --stages {manifest.num_stages}, or a GGUF / HF folder to build any count")
    have = {d.name for d in manifest.drafts}
    if missing := [d for d in drafts if d not in have]:
        raise ModelError(f"--model {build} has no {', '.join(missing)} draft (it has: {', '.join(sorted(have)) or 'none'}"
                         f"); build one with fleet-compiler build SRC {' '.join('--draft ' + d for d in missing)}")


def check_stages(model: Model, stages: list[int] | set[int], drafts: tuple[str, ...] = ()) -> None:
    """Raise :class:`ModelError` if ``model`` is a build folder without every count of ``stages`` and every one
    of ``drafts`` (:func:`check_build`); a GGUF or an HF folder builds any (a bench's options are checked
    before its long runs start)."""
    if model.kind == "build":
        for n in sorted(set(stages)):
            check_build(model.path, n, drafts)


def builds(model: Model, cache: Path, stages: list[int] | set[int], optional: tuple[int, ...] = (),
           drafts: tuple[str, ...] = ()) -> dict[int, Path]:
    """{stage count: build} for every count in ``stages`` and, where there is one, in ``optional``: built
    from a source (``harness.ensure_build``), or the build folder itself (:func:`check_build` refuses a count
    in ``stages`` it does not have; an ``optional`` count it does not have is left out)."""
    wanted = sorted({*stages, *optional})
    if model.kind != "build":
        return {n: harness.ensure_build(model.path, cache, n, drafts=drafts) for n in wanted}
    check_stages(model, stages, drafts)
    have = model.stages
    return {have: model.path} if have in wanted else {}


def stage_counts(model: Model, given: list[int] | None, default: list[int]) -> list[int]:
    """The stage counts a bench runs: ``given`` (its ``--stages``), else a build folder's own, else ``default``."""
    if given:
        return given
    return [model.stages] if model.kind == "build" else default


def even_split(build: Path, parts: int = 2) -> str:
    """``--layers`` ranges cutting ``build``'s model into ``parts`` runs of equal layer counts (the split that
    ignores the LM head's weight), e.g. ``0:15,15:30`` for the demo's 30 layers."""
    layers = architecture(build).num_layers
    cuts = [round(i * layers / parts) for i in range(parts + 1)]
    return ",".join(f"{a}:{b}" for a, b in zip(cuts, cuts[1:]))


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def counts(text: str) -> list[int]:
    """argparse type: comma-separated integers >= 1 (``"1,2,4"``)."""
    return [positive_int(part) for part in text.split(",")]
