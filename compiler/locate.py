"""Models where people keep them: what ``fleet-compiler build`` accepts as its source, resolved to a file or
folder on this disk. Nothing is downloaded and no server is asked; only files are read.

* A path: a ``.gguf`` file (the first part of a split one), a Hugging Face folder (``config.json``), or a folder
  of ``.gguf`` files (LM Studio's per-model folders): with one model file it is taken, with several (one per
  quantization) the build is refused with the list unless one is named, ``FOLDER@Q4_K_M`` or ``FOLDER/FILE.gguf``.
* An Ollama model name (``llama3.2:1b``, ``library/qwen2.5:0.5b``, ``host/namespace/model:tag``) in Ollama's
  store, ``$OLLAMA_MODELS`` or ``~/.ollama/models`` (ollama/ollama ``envconfig/config.go`` ``Models``; the Linux
  service installer's store is ``/usr/share/ollama/.ollama/models``, ``docs/faq.mdx`` "Where are models stored?",
  found only through ``OLLAMA_MODELS``). A name is ``{host}/{namespace}/{model}:{tag}`` with the defaults
  ``registry.ollama.ai``, ``library``, ``latest`` (``types/model/name.go``: ``ParseNameBare``, ``DefaultName``,
  part rules in ``isValidPart``); its manifest is the JSON file ``manifests/{host}/{namespace}/{model}/{tag}``
  (``Name.Filepath``, ``manifest/paths.go``) whose ``layers`` list ``mediaType``, ``digest`` and ``size``
  (``manifest/manifest.go``, ``manifest/layer.go``). The layer of media type
  ``application/vnd.ollama.image.model`` is the GGUF (the last one wins, as in ``server/images.go``; projector,
  template and params layers are not weights), stored at ``blobs/sha256-<hex>`` (``BlobsPath``: the digest's
  ``:`` becomes ``-``). Sources: github.com/ollama/ollama at fb30760996871fa9460115c753afd2c60d4ab0f7.
* An LM Studio model: ``publisher/model`` (or ``model`` alone when one publisher has it, ``...@QUANT`` or
  ``.../FILE.gguf`` to name a quantization), a folder ``<models>/<publisher>/<model>/`` holding the ``.gguf``
  files ("LM Studio's expected models directory structure", lmstudio.ai/docs/app/advanced/import-model: two
  levels below the models folder). The models folder is ``<home>/models``, home found as LM Studio's own SDK
  finds it (lmstudio-ai/lmstudio-js ``packages/lms-common-server/src/findLMStudioHome.ts``): the path in
  ``~/.lmstudio-home-pointer``, else ``~/.cache/lm-studio`` (older versions), else ``~/.lmstudio``; all that
  exist are searched. Names match without regard to case. ``mmproj-*.gguf`` (vision projectors) and later parts
  of split files are not model choices.

Integrity of an Ollama blob: its size is checked against the manifest's ``size`` and its first bytes against
GGUF's magic; its sha256 is not recomputed (that reads every byte of a multi-GB blob before the build starts:
sha256 hashes ~1.5 GB/s on this machine's CPU, plus the disk's read; Ollama checks the digest when it pulls), so
a same-size corruption is left to the GGUF reader.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from .gguf import SPLIT_NAME, is_gguf_file
from .source import is_gguf_path

OLLAMA_HOST, OLLAMA_NAMESPACE, OLLAMA_TAG = "registry.ollama.ai", "library", "latest"  # name.go DefaultName
OLLAMA_MODEL_LAYER = "application/vnd.ollama.image.model"
_OLLAMA_PART = {  # name.go isValidPart: first char alphanumeric or "_", then these; lengths 1..80 (host 350)
    "host": (re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.:-]*$"), 350),
    "namespace": (re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_-]*$"), 80),
    "model": (re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$"), 80),
    "tag": (re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$"), 80),
}
_DIGEST = re.compile(r"^sha256[:-]([0-9a-fA-F]{64})$")  # manifest/paths.go BlobsPath


class LocateError(ValueError):
    """A model name or folder that does not resolve to one model file; the message says what was found."""


@dataclass(frozen=True)
class Located:
    """Where a build's source is: ``path`` (a GGUF file, the first part of a split one, or an HF folder),
    ``model_id`` (the name its manifest carries; None: the build's default, the file's stem or folder's name)
    and ``origin`` ("path", "ollama" or "lmstudio")."""

    path: Path
    model_id: str | None
    origin: str


def locate(spec: str) -> Located:
    """Resolve ``spec`` (module docstring: a path, an Ollama name or an LM Studio model) to a file or folder.

    Raises ``FileNotFoundError`` for a path that does not exist or an Ollama blob that is missing,
    ``LocateError`` for a name found nowhere (listing the Ollama and LM Studio models there are), a folder
    with several model files and none named (listing them), or an Ollama manifest or blob that is malformed,
    not a GGUF or not the size its manifest says."""
    path = Path(spec).expanduser()
    if path.exists():
        return _from_path(path, None)
    base, at, quant = spec.rpartition("@")
    if at and Path(base).expanduser().is_dir():
        return _from_path(Path(base).expanduser(), quant)
    name = parse_ollama_name(spec)
    if name is not None and (manifest := _ollama_manifest(name)) is not None:
        return _ollama_blob(_manifest_name(manifest), manifest)
    if (folder := _lmstudio_folder(base if at else spec)) is not None:
        return _lmstudio_model(folder, quant if at else None, base if at else spec)
    if spec.startswith((os.sep, ".", "~")) or spec.endswith(".gguf"):
        raise FileNotFoundError(f"{spec}: no such file or folder")
    raise LocateError(f"{spec!r} is not a file or folder, an Ollama model ({_listing(ollama_models(), ollama_store())})"
                      f" nor an LM Studio model ({_listing(lmstudio_models(), *lmstudio_roots())}); nothing is "
                      "downloaded: give a .gguf path or a model one of them has")


def _from_path(path: Path, quant: str | None) -> Located:
    """An existing ``path``: a GGUF file, an HF folder or a folder of GGUF files (``quant`` names one)."""
    if path.is_file():
        if quant is not None:
            raise LocateError(f"{path}@{quant}: a quantization is named for a folder, {path} is a file")
        if not is_gguf_path(path):
            raise LocateError(f"{path} is not a GGUF file (it does not start with b'GGUF') nor a folder")
        return Located(path, _stem(path) if SPLIT_NAME.match(path.name) else None, "path")
    if (path / "config.json").is_file() and quant is None:
        return Located(path, None, "path")
    return Located(*_choose_gguf(path, quant, str(path)), "path")


# --- Ollama -----------------------------------------------------------------------------------------------

def ollama_store() -> Path:
    """Ollama's models folder: ``$OLLAMA_MODELS``, else ``~/.ollama/models`` (envconfig.Models)."""
    return Path(os.environ.get("OLLAMA_MODELS") or Path.home() / ".ollama" / "models").expanduser()


def parse_ollama_name(spec: str) -> tuple[str, str, str, str] | None:
    """``(host, namespace, model, tag)`` of an Ollama name, defaults filled in (name.go ``ParseName``), or None
    when ``spec`` is not a valid one (a part empty, too long or with characters ``isValidPart`` refuses)."""
    rest, tag = spec, OLLAMA_TAG
    if rest.rfind(":") > rest.rfind("/"):
        rest, _, tag = rest.rpartition(":")
    parts = rest.rsplit("/", 2)  # a separator promises a part: empty ones make the name invalid, as in Go
    if "" in parts or not tag:
        return None
    host, namespace, model = [""] * (3 - len(parts)) + parts
    host = host.split("://", 1)[-1]
    name = (host or OLLAMA_HOST, namespace or OLLAMA_NAMESPACE, model, tag)
    for kind, part in zip(("host", "namespace", "model", "tag"), name):
        pattern, longest = _OLLAMA_PART[kind]
        if not pattern.match(part) or len(part) > longest:
            return None
    return name


def _display(name: tuple[str, str, str, str]) -> str:
    """name.go ``DisplayShortest``: ``model:tag``, with the namespace (and host) when not the defaults."""
    host, namespace, model, tag = name
    if host.lower() != OLLAMA_HOST:
        return f"{host}/{namespace}/{model}:{tag}"
    return f"{model}:{tag}" if namespace.lower() == OLLAMA_NAMESPACE else f"{namespace}/{model}:{tag}"


def _ollama_manifests() -> dict[tuple[str, str, str, str], Path]:
    """Every manifest in the store: ``manifests/{host}/{namespace}/{model}/{tag}`` files."""
    root = ollama_store() / "manifests"
    found = {}
    for path in sorted(root.glob("*/*/*/*")) if root.is_dir() else []:
        if path.is_file():
            found[tuple(path.relative_to(root).parts)] = path
    return found


def ollama_models() -> list[str]:
    """The names of the models in Ollama's store, as ``ollama list`` shows them."""
    return sorted((_display(name) for name in _ollama_manifests()), key=str.lower)


def _ollama_manifest(name: tuple[str, str, str, str]) -> Path | None:
    """The manifest file of ``name`` (exact path first, then any case, as ``Name.EqualFold``), or None."""
    exact = ollama_store() / "manifests" / Path(*name)
    if exact.is_file():
        return exact
    folded = tuple(p.lower() for p in name)
    return next((path for other, path in _ollama_manifests().items()
                 if tuple(p.lower() for p in other) == folded), None)


def _manifest_name(manifest: Path) -> tuple[str, str, str, str]:
    """The name a manifest file stands for, as spelled on disk (name.go ``ParseNameFromFilepath``)."""
    return tuple(manifest.relative_to(ollama_store() / "manifests").parts)


def _ollama_blob(name: tuple[str, str, str, str], manifest: Path) -> Located:
    """The GGUF blob of an Ollama manifest, its size checked against the manifest's (module docstring)."""
    shown = _display(name)
    try:
        layers = json.loads(manifest.read_text())["layers"]
        models = [layer for layer in layers if layer.get("mediaType") == OLLAMA_MODEL_LAYER]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise LocateError(f"Ollama manifest {manifest} of {shown} is not a manifest ({exc})") from None
    if not models:
        kinds = sorted({str(layer.get("mediaType")) for layer in layers if isinstance(layer, dict)})
        raise LocateError(f"Ollama model {shown} has no GGUF weights (no {OLLAMA_MODEL_LAYER} layer in {manifest}; "
                          f"its layers: {', '.join(kinds) or 'none'})")
    layer = models[-1]
    digest = _DIGEST.match(str(layer.get("digest", "")))
    if digest is None:
        raise LocateError(f"Ollama manifest {manifest}: model layer digest {layer.get('digest')!r} is not sha256:<hex>")
    blob = ollama_store() / "blobs" / f"sha256-{digest[1]}"
    if not blob.is_file():
        raise FileNotFoundError(f"Ollama model {shown}: its weights blob {blob} is missing (manifest {manifest}); "
                                f"`ollama pull {shown}` fetches it again")
    size, expected = blob.stat().st_size, layer.get("size")
    if isinstance(expected, int) and size != expected:
        raise LocateError(f"Ollama model {shown}: blob {blob} is {size} bytes, its manifest says {expected}: an "
                          f"incomplete or damaged download; `ollama pull {shown}` again (sizes are checked, the "
                          "sha256 of a multi-GB blob is not recomputed)")
    if not is_gguf_file(blob):
        raise LocateError(f"Ollama model {shown}: blob {blob} is not a GGUF file (no b'GGUF' magic)")
    return Located(blob, shown, "ollama")


# --- LM Studio --------------------------------------------------------------------------------------------

def lmstudio_roots() -> list[Path]:
    """LM Studio models folders that exist, in the order findLMStudioHome.ts looks for its home."""
    home = Path.home()
    homes = []
    pointer = home / ".lmstudio-home-pointer"
    if pointer.is_file():
        homes.append(Path(pointer.read_text(encoding="utf-8").strip()).expanduser())
    homes += [home / ".cache" / "lm-studio", home / ".lmstudio"]
    roots: list[Path] = []
    for h in homes:
        if (h / "models").is_dir() and (h / "models").resolve() not in [r.resolve() for r in roots]:
            roots.append(h / "models")
    return roots


def _lmstudio_folders() -> dict[str, Path]:
    """``publisher/model`` -> folder, for every folder two levels below a models root holding a ``.gguf``."""
    found: dict[str, Path] = {}
    for root in lmstudio_roots():
        for folder in sorted(root.glob("*/*")):
            if folder.is_dir() and any(folder.glob("*.gguf")):
                found.setdefault(f"{folder.parent.name}/{folder.name}", folder)
    return found


def lmstudio_models() -> list[str]:
    """The ``publisher/model`` keys of the GGUF models in LM Studio's folders."""
    return sorted(_lmstudio_folders(), key=str.lower)


def _lmstudio_folder(key: str) -> Path | tuple[Path, str] | None:
    """The folder of LM Studio key ``publisher/model`` or ``model`` (any case), with a file name when ``key``
    ends in ``/FILE.gguf``; None when no folder matches. ``LocateError`` for a bare model name two publishers
    have."""
    file = None
    if key.lower().endswith(".gguf"):
        key, _, file = key.rpartition("/")
    folders = _lmstudio_folders()
    if "/" in key:
        match = [f for k, f in folders.items() if k.lower() == key.lower()]
    else:
        match = [f for k, f in folders.items() if k.split("/")[1].lower() == key.lower()]
    if len(match) > 1:
        raise LocateError(f"LM Studio model {key!r} is in several folders: "
                          f"{', '.join(str(m) for m in match)}; give publisher/model")
    if not match:
        return None
    return (match[0], file) if file else match[0]


def _lmstudio_model(found: Path | tuple[Path, str], quant: str | None, key: str) -> Located:
    folder, file = found if isinstance(found, tuple) else (found, None)
    if file is not None:
        path = next((p for p in folder.glob("*.gguf") if p.name.lower() == file.lower()), None)
        if path is None:
            raise LocateError(f"LM Studio model {key!r}: no {file} in {folder} (there: "
                              f"{', '.join(p.name for p in _model_files(folder)) or 'no model file'})")
        return Located(path, _stem(path), "lmstudio")
    path, model_id = _choose_gguf(folder, quant, key)
    return Located(path, model_id, "lmstudio")


# --- a folder of GGUF files -------------------------------------------------------------------------------

def _model_files(folder: Path) -> list[Path]:
    """The model choices in ``folder``: its ``.gguf`` files but vision projectors and later split parts."""
    files = []
    for path in sorted(folder.glob("*.gguf")):
        split = SPLIT_NAME.match(path.name)
        if path.name.lower().startswith("mmproj") or (split and int(split["no"]) != 1):
            continue
        files.append(path)
    return files


def _choose_gguf(folder: Path, quant: str | None, shown: str) -> tuple[Path, str]:
    """The one model file of ``folder`` (or the one whose name has the label ``quant``, e.g. ``Q4_K_M``) and
    its model id (the name without ``.gguf`` and split suffix). ``LocateError`` listing the files otherwise."""
    files = _model_files(folder)
    if not files:
        raise LocateError(f"{folder} has no config.json (Hugging Face folder) and no .gguf model file")
    if quant is not None:
        label = re.compile(rf"(?<![A-Za-z0-9]){re.escape(quant)}(?![A-Za-z0-9])", re.IGNORECASE)
        named = [f for f in files if label.search(_stem(f))]
        if not named:
            raise LocateError(f"{shown}@{quant}: no file named with {quant!r} in {folder}; there are "
                              f"{', '.join(f.name for f in files)}")
        files = named
    if len(files) > 1:
        raise LocateError(f"{shown} holds {len(files)} models ({folder}): {', '.join(f.name for f in files)}; "
                          f"name one, e.g. {shown}@{_label(files[0])} or {folder / files[0].name}")
    return files[0], _stem(files[0])


def _stem(path: Path) -> str:
    split = SPLIT_NAME.match(path.name)
    return split["prefix"] if split else path.stem


def _label(path: Path) -> str:
    """The quantization label a file name ends with (``...-Q4_K_M.gguf`` -> ``Q4_K_M``), else its stem."""
    return re.split(r"[-.]", _stem(path))[-1]


def _listing(names: list[str], *where: Path) -> str:
    places = ", ".join(str(w) for w in where) or "no folder found"
    if not names:
        return f"none in {places}"
    shown = ", ".join(names[:20]) + (f", ... ({len(names)} in all)" if len(names) > 20 else "")
    return f"in {places}: {shown}"
