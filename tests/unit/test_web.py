"""The chat page's serving (coordinator/api/web.py): routes, headers, the key middleware leaving the page open,
the addresses ``serve`` prints, and the static files in a built wheel."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from fastapi import FastAPI
from fastapi.testclient import TestClient

from coordinator.api.app import ApiKeys
from coordinator.api.web import STATIC, add_web_routes, lan_addresses, page_urls

ROOT = Path(__file__).resolve().parents[2]
# every file of the page: its ES modules (app.js imports the others), the vendored renderer and its licence
PAGE_FILES = ("index.html", "style.css", "app.js", "conversation.js", "dom.js", "fleet.js", "fleet_state.js", "markdown.js",
              "messages.js", "request.js", "sse.js", "tools.js", "vendor/markdown-it.esm.min.js", "vendor/markdown-it.LICENSE")


def test_page_and_static_files_are_open_while_the_api_needs_a_key():
    app = FastAPI()
    add_web_routes(app)

    @app.get("/v1/models")
    def models() -> dict:
        return {"data": []}

    app.add_middleware(ApiKeys, keys=["k"])
    client = TestClient(app)
    page = client.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "script-src 'self'" in page.headers["content-security-policy"]
    assert '<script type="module" src="/static/app.js">' in page.text and "http" not in page.text.split("<body>")[0]
    head = client.head("/")  # the Ollama CLI's heartbeat
    assert head.status_code == 200 and not head.content
    icon = client.get("/favicon.ico")  # asked for by a browser on a /static/ file: a 404 is a console error
    assert icon.status_code == 204 and not icon.content
    for name in PAGE_FILES:
        r = client.get(f"/static/{name}")
        assert r.status_code == 200 and r.content == (STATIC / name).read_bytes()
    for name in PAGE_FILES:  # a module script of another type is refused by the browser (nosniff)
        if name.endswith(".js"):
            r = client.get(f"/static/{name}")
            assert r.headers["content-type"].split(";")[0] in ("text/javascript", "application/javascript"), name
            assert r.headers["content-security-policy"] == page.headers["content-security-policy"], name
            assert r.headers["x-content-type-options"] == "nosniff", name
    assert client.get("/static/../web.py").status_code == 404
    assert client.get("/static/missing.js").status_code == 404
    assert client.get("/v1/models").status_code == 401
    assert client.get("/v1/models", headers={"Authorization": "Bearer k"}).status_code == 200


def test_the_page_fetches_nothing_from_elsewhere():
    """Works on a LAN without internet: no absolute URL in a src, href, url() or fetch of the page's files."""
    for name in PAGE_FILES:
        text = (STATIC / name).read_text()
        for marker in ('src="http', "href=\"http", "url(http", "fetch(\"http", "fetch('http", "@import"):
            assert marker not in text, (name, marker)


def test_page_urls():
    assert page_urls("127.0.0.1", 8000) == ["http://127.0.0.1:8000/"]
    assert page_urls("::1", 8000) == ["http://[::1]:8000/"]
    assert page_urls("192.168.1.20", 80) == ["http://192.168.1.20:80/"]
    wildcard = page_urls("0.0.0.0", 8000)
    assert wildcard[-1] == "http://127.0.0.1:8000/"
    assert wildcard[:-1] == [f"http://{ip}:8000/" for ip in lan_addresses()]
    assert all(not ip.startswith(("127.", "169.254.")) for ip in lan_addresses())


def test_a_built_wheel_holds_the_page(tmp_path):
    """A non-editable install gets the static files (pyproject's package-data), not only the editable one."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for package in ("fleet_common", "compiler", "worker", "coordinator", "bench"):
        shutil.copytree(ROOT / package, src / package, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "--disable-pip-version-check", "-w", str(tmp_path / "dist"), str(src)],
                   check=True, capture_output=True, timeout=120)
    (wheel,) = (tmp_path / "dist").glob("fleet-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {f"coordinator/api/static/{name}" for name in PAGE_FILES} <= names
    assert "coordinator/api/web.py" in names


def test_every_module_the_page_imports_is_a_page_file():
    """The modules import one another by relative path only (nothing from elsewhere, no bundler), and each
    one imported is in PAGE_FILES (so the tests above serve it and find it in a wheel)."""
    imported = set()
    for name in PAGE_FILES:
        if name.endswith(".js") and not name.startswith("vendor/"):
            for spec in re.findall(r"""^import\s[^;]*?from\s+["']([^"']+)["']""", (STATIC / name).read_text(), re.M):
                assert spec.startswith("./"), (name, spec)
                imported.add(spec[2:])
    assert "markdown.js" in imported and "vendor/markdown-it.esm.min.js" in imported
    assert imported <= set(PAGE_FILES), imported - set(PAGE_FILES)
