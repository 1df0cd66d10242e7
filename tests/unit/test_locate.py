"""compiler/locate.py: build sources named as Ollama and LM Studio keep them, on real directory trees made here
in the layouts their sources describe (locate.py's docstring) with a real tiny GGUF as the weights, under a
fake HOME and OLLAMA_MODELS; and one ``fleet-compiler build llama-tiny:latest`` end to end."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess

import pytest

from compiler.locate import LocateError, locate, parse_ollama_name
from compiler.source import DEMO_GGUF
from tests.conftest import BIN
from tests.integration.test_gguf import write_tiny_gguf

MODEL_LAYER = "application/vnd.ollama.image.model"


@pytest.fixture(scope="module")
def tiny_gguf(demo_hf, tmp_path_factory):
    """A real tiny llama GGUF (write_tiny_gguf, the demo's first 2048 tokens): builds in seconds."""
    path = tmp_path_factory.mktemp("tiny") / "llama-tiny.gguf"
    write_tiny_gguf(path, demo_hf / DEMO_GGUF, vocab=2048)
    return path


@pytest.fixture
def home(tmp_path, monkeypatch):
    """An empty HOME with no OLLAMA_MODELS: nothing of this machine's own stores is seen."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("OLLAMA_MODELS", raising=False)
    (tmp_path / "home").mkdir()
    return tmp_path / "home"


def add_ollama_model(store, name: str, weights: bytes, *, size: int | None = None, model_layer: bool = True):  # noqa: ANN001, ANN201
    """Write ``name`` (``[namespace/]model:tag``) into Ollama store ``store`` as ``ollama pull`` leaves it: a
    manifest (schemaVersion 2: config layer, model layer, template and params layers) and the blobs
    ``sha256-<hex>`` of each layer. ``size`` overrides the model layer's recorded size. Returns the model blob."""
    namespace, _, rest = name.rpartition("/")
    model, _, tag = rest.partition(":")

    def blob(data: bytes, media: str, recorded: int | None = None) -> dict:
        digest = hashlib.sha256(data).hexdigest()
        (store / "blobs").mkdir(parents=True, exist_ok=True)
        (store / "blobs" / f"sha256-{digest}").write_bytes(data)
        return {"mediaType": media, "digest": f"sha256:{digest}", "size": len(data) if recorded is None else recorded}

    layers = [blob(b"{{ .Prompt }}", "application/vnd.ollama.image.template"),
              blob(b'{"temperature": 0.7}', "application/vnd.ollama.image.params")]
    if model_layer:
        layers.insert(0, blob(weights, MODEL_LAYER, size))
    manifest = {"schemaVersion": 2, "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
                "config": blob(b'{"model_format": "gguf"}', "application/vnd.docker.container.image.v1+json"),
                "layers": layers}
    path = store / "manifests" / "registry.ollama.ai" / (namespace or "library") / model / (tag or "latest")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(manifest))
    return store / "blobs" / f"sha256-{hashlib.sha256(weights).hexdigest()}"


def test_ollama_names_parse_as_ollama_parses_them():
    assert parse_ollama_name("llama3.2:1b") == ("registry.ollama.ai", "library", "llama3.2", "1b")
    assert parse_ollama_name("library/qwen2.5:0.5b") == ("registry.ollama.ai", "library", "qwen2.5", "0.5b")
    assert parse_ollama_name("someone/phi3") == ("registry.ollama.ai", "someone", "phi3", "latest")
    assert parse_ollama_name("localhost:5000/ns/m:q4") == ("localhost:5000", "ns", "m", "q4")
    assert parse_ollama_name("https://example.com/ns/m") == ("example.com", "ns", "m", "latest")
    for bad in ("a/b/c/d", "-x", "x:", "ns.with.dots/m", "m:t/a", ""):
        assert parse_ollama_name(bad) is None, bad


def test_an_ollama_name_resolves_to_its_gguf_blob(home, tmp_path, tiny_gguf, monkeypatch):
    store = tmp_path / "ollama"
    monkeypatch.setenv("OLLAMA_MODELS", str(store))
    blob = add_ollama_model(store, "llama-tiny:latest", tiny_gguf.read_bytes())
    add_ollama_model(store, "someone/qwen-tiny:q4", tiny_gguf.read_bytes()[:-1] + b"x")
    for name in ("llama-tiny:latest", "llama-tiny", "library/llama-tiny", "registry.ollama.ai/library/llama-tiny:latest",
                 "LLAMA-Tiny:Latest"):
        found = locate(name)
        assert (found.path, found.model_id, found.origin) == (blob, "llama-tiny:latest", "ollama"), name
    assert locate("someone/qwen-tiny:q4").model_id == "someone/qwen-tiny:q4"
    with pytest.raises(LocateError) as refused:
        locate("mistral:7b")
    assert "'mistral:7b'" in str(refused.value) and str(store) in str(refused.value)
    assert "llama-tiny:latest, someone/qwen-tiny:q4" in str(refused.value)


def test_ollama_store_defaults_to_home(home, tiny_gguf):
    blob = add_ollama_model(home / ".ollama" / "models", "llama-tiny:latest", tiny_gguf.read_bytes())
    assert locate("llama-tiny").path == blob


def test_a_damaged_ollama_model_is_refused_clearly(home, tmp_path, tiny_gguf, monkeypatch):
    store = tmp_path / "ollama"
    monkeypatch.setenv("OLLAMA_MODELS", str(store))
    data = tiny_gguf.read_bytes()
    short = add_ollama_model(store, "short:latest", data[: len(data) // 2], size=len(data))
    with pytest.raises(LocateError, match=rf"{short.name} is {len(data) // 2} bytes, its manifest says {len(data)}"):
        locate("short")
    gone = add_ollama_model(store, "gone:latest", data + b"\0")
    gone.unlink()
    with pytest.raises(FileNotFoundError, match=rf"{gone.name} is missing .*ollama pull gone:latest"):
        locate("gone")
    add_ollama_model(store, "not-gguf:latest", b"PK\x03\x04" + data[4:])
    with pytest.raises(LocateError, match="is not a GGUF file"):
        locate("not-gguf")
    add_ollama_model(store, "no-weights:latest", data, model_layer=False)
    with pytest.raises(LocateError, match=rf"no {MODEL_LAYER} layer.*application/vnd.ollama.image.params"):
        locate("no-weights")
    broken = store / "manifests" / "registry.ollama.ai" / "library" / "broken" / "latest"
    broken.parent.mkdir(parents=True)
    broken.write_text("{not json")
    with pytest.raises(LocateError, match=f"Ollama manifest {broken} of broken:latest is not a manifest"):
        locate("broken")


def lmstudio_model(models, key: str, *files: str, source=None):  # noqa: ANN001, ANN201
    """``models/<publisher>/<model>/`` with ``files`` (copies of ``source``, or a few bytes)."""
    folder = models / key
    folder.mkdir(parents=True, exist_ok=True)
    for name in files:
        if source is not None:
            shutil.copy(source, folder / name)
        else:
            (folder / name).write_bytes(b"GGUF")
    return folder


def test_an_lm_studio_model_resolves_by_key_or_folder(home, tiny_gguf):
    models = home / ".lmstudio" / "models"
    one = lmstudio_model(models, "lmstudio-community/Tiny-Llama-GGUF", "Tiny-Llama-Q4_0.gguf", source=tiny_gguf)
    for key in ("lmstudio-community/Tiny-Llama-GGUF", "LMStudio-Community/tiny-llama-gguf", "Tiny-Llama-GGUF", str(one)):
        found = locate(key)
        assert (found.path, found.model_id) == (one / "Tiny-Llama-Q4_0.gguf", "Tiny-Llama-Q4_0"), key
    assert locate(key).origin == "path" and locate("Tiny-Llama-GGUF").origin == "lmstudio"


def test_an_lm_studio_folder_of_several_quantizations_needs_one_named(home):
    models = home / ".lmstudio" / "models"
    folder = lmstudio_model(models, "bartowski/Qwen-Tiny-GGUF", "Qwen-Tiny-Q4_K_M.gguf", "Qwen-Tiny-Q8_0.gguf",
                            "mmproj-Qwen-Tiny-f16.gguf", "Qwen-Tiny-Q2_K-00001-of-00002.gguf",
                            "Qwen-Tiny-Q2_K-00002-of-00002.gguf")
    for spec in ("bartowski/Qwen-Tiny-GGUF", str(folder)):
        with pytest.raises(LocateError) as refused:
            locate(spec)
        message = str(refused.value)
        assert "holds 3 models" in message and "mmproj" not in message and "00002-of" not in message, message
        assert "Qwen-Tiny-Q2_K-00001-of-00002.gguf, Qwen-Tiny-Q4_K_M.gguf, Qwen-Tiny-Q8_0.gguf" in message
        assert f"{spec}@Q2_K" in message
    assert locate("bartowski/Qwen-Tiny-GGUF@q8_0").path == folder / "Qwen-Tiny-Q8_0.gguf"
    assert locate(f"{folder}@Q4_K_M").path == folder / "Qwen-Tiny-Q4_K_M.gguf"
    split = locate("Qwen-Tiny-GGUF@Q2_K")
    assert (split.path.name, split.model_id) == ("Qwen-Tiny-Q2_K-00001-of-00002.gguf", "Qwen-Tiny-Q2_K")
    assert locate("bartowski/Qwen-Tiny-GGUF/qwen-tiny-q8_0.gguf").path == folder / "Qwen-Tiny-Q8_0.gguf"
    with pytest.raises(LocateError, match="no file named with 'Q5_K_S'.*Qwen-Tiny-Q8_0.gguf"):
        locate("bartowski/Qwen-Tiny-GGUF@Q5_K_S")


def test_older_and_moved_lm_studio_homes_are_searched(home, tmp_path):
    old = lmstudio_model(home / ".cache" / "lm-studio" / "models", "TheBloke/Old-GGUF", "old.Q4_0.gguf")
    moved = tmp_path / "elsewhere"
    (home / ".lmstudio-home-pointer").write_text(f"{moved}\n")
    new = lmstudio_model(moved / "models", "someone/New-GGUF", "new-Q8_0.gguf")
    assert locate("TheBloke/Old-GGUF").path == old / "old.Q4_0.gguf"
    assert locate("someone/New-GGUF").path == new / "new-Q8_0.gguf"
    with pytest.raises(LocateError) as refused:
        locate("nothing-here")
    assert "someone/New-GGUF, TheBloke/Old-GGUF" in str(refused.value)


def test_paths(home, tmp_path, tiny_gguf):
    assert locate(str(tiny_gguf)) == locate(str(tiny_gguf)) and locate(str(tiny_gguf)).model_id is None
    part = tmp_path / "big-00001-of-00003.gguf"
    shutil.copy(tiny_gguf, part)
    assert locate(str(part)).model_id == "big"
    with pytest.raises(FileNotFoundError, match="missing.gguf: no such file"):
        locate(str(tmp_path / "missing.gguf"))
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    assert locate(str(tmp_path / "hf")).path == tmp_path / "hf"
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(LocateError, match="not a GGUF file"):
        locate(str(tmp_path / "notes.txt"))


def test_build_an_ollama_model_by_name(home, tmp_path, tiny_gguf):
    """``fleet-compiler build llama-tiny:latest`` reads the blob through OLLAMA_MODELS; the manifest carries the name."""
    store = tmp_path / "ollama"
    blob = add_ollama_model(store, "llama-tiny:latest", tiny_gguf.read_bytes())
    env = {"HOME": str(home), "OLLAMA_MODELS": str(store), "PATH": "/usr/bin:/bin"}
    out = tmp_path / "build"
    result = subprocess.run([str(BIN / "fleet-compiler"), "build", "llama-tiny:latest", "--shards", "2", "-o", str(out)],
                            capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"ollama model llama-tiny:latest: {blob}" in result.stdout
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["model_id"] == "llama-tiny:latest" and len(manifest["stages"]) == 2
    assert all(s["weights"] == "gguf" for s in manifest["stages"])
    refused = subprocess.run([str(BIN / "fleet-compiler"), "build", "llama-huge:70b", "-o", str(tmp_path / "b2")],
                             capture_output=True, text=True, timeout=300, env=env)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert "'llama-huge:70b' is not a file or folder, an Ollama model (in" in refused.stderr
    assert "llama-tiny:latest" in refused.stderr and not (tmp_path / "b2").exists()
