"""The web UI's files as shipped, without a browser: the vendored libraries are those scripts/vendor_webui.py pins
(SHA-256 of each file, licenses beside them) and ship in the package; the page loads only its own files, with no
inline script or style; the UI's own JS writes no HTML and keeps no key in localStorage; and the security-headers
middleware puts the UI's headers on its paths only."""
import hashlib
import importlib.util
import json
import re
from pathlib import Path

import tomllib
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from qwenserve.entrypoints.openai.middleware import UI_SECURITY_HEADERS, UISecurityHeadersMiddleware

ROOT = Path(__file__).resolve().parent.parent
WEBUI = ROOT / "qwenserve" / "entrypoints" / "openai" / "webui"
VENDOR = WEBUI / "vendor"


def vendor_script():
    spec = importlib.util.spec_from_file_location("vendor_webui", ROOT / "scripts" / "vendor_webui.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_vendored_files_are_the_pinned_ones_with_their_licenses():
    manifest = json.loads((VENDOR / "manifest.json").read_text())["files"]
    # every file under vendor/ is in the manifest, with the hash it was fetched with
    assert sorted(e["file"] for e in manifest) == sorted(p.name for p in VENDOR.iterdir() if p.name != "manifest.json")
    for e in manifest:
        assert hashlib.sha256((VENDOR / e["file"]).read_bytes()).hexdigest() == e["sha256"], e["file"]
    # the manifest is what the script writes for its pins: exact versions, each package with its license
    pinned = {(package, version, source, name) for package, version, files in vendor_script().PACKAGES
              for source, name in files.items()}
    assert {(e["package"], e["version"], e["source"], e["file"]) for e in manifest} == pinned
    assert all(re.fullmatch(r"\d+\.\d+\.\d+", version) for _, version, _, _ in pinned)
    for package in {e["package"] for e in manifest}:
        assert any(e["package"] == package and "LICENSE" in e["source"] for e in manifest), package
    assert "DOMPurify 3.5.0" in (VENDOR / "purify.min.js").read_text()[:200]


def test_ui_files_ship_in_the_package():
    globs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"][
        "qwenserve.entrypoints.openai"]
    files = [p.relative_to(WEBUI.parent) for p in WEBUI.rglob("*") if p.is_file()]
    assert Path("webui/vendor/purify.min.js") in files
    # a glob's * stays inside one directory, as setuptools reads it
    assert [f for f in files if not any(f.match(g) and len(f.parts) == len(Path(g).parts) for g in globs)] == []


def test_page_loads_only_its_own_files_and_has_no_inline_script_or_style():
    html = (WEBUI / "index.html").read_text()
    scripts = re.findall(r"<script\b([^>]*)>", html)
    assert scripts and all(re.fullmatch(r' src="/ui/[\w./-]+"', attrs) for attrs in scripts), scripts
    for attrs in scripts:
        assert (WEBUI / re.search(r'src="/ui/([^"]+)"', attrs)[1]).is_file()
    assert "<style" not in html and not re.search(r"\sstyle=|\son\w+=|javascript:", html)
    assert not re.search(r'(?:src|href)="(?:https?:)?//', html)  # no CDN


def test_ui_scripts_write_no_html_and_keep_no_key_in_local_storage():
    for name in ("app.js", "render.js"):
        code = re.sub(r"^\s*//.*$", "", (WEBUI / name).read_text(), flags=re.M)  # comments may name them
        assert not re.search(r"(?:innerHTML|outerHTML)\s*\+?=|insertAdjacentHTML|document\.write|\beval\(|"
                             r"new Function|setTimeout\(\s*[\"'`]", code), name
        assert "localStorage.setItem" not in code, name


def headers_app():
    async def page(request):
        return PlainTextResponse("x", headers={"content-security-policy": "default-src *"})
    app = Starlette(routes=[Route("/", page), Route("/ui/a.js", page), Route("/v1/models", page)])
    return UISecurityHeadersMiddleware(app, lambda path: path == "/" or path.startswith("/ui/"))


def test_security_headers_go_on_ui_paths_only_and_replace_the_apps():
    client = TestClient(headers_app())
    expected = {k.decode(): v.decode() for k, v in UI_SECURITY_HEADERS}
    for path, status in (("/", 200), ("/ui/a.js", 200), ("/ui/missing.js", 404)):
        resp = client.get(path)
        assert resp.status_code == status
        assert {k: resp.headers.get_list(k) for k in expected} == {k: [v] for k, v in expected.items()}, path
    other = client.get("/v1/models").headers
    assert other["content-security-policy"] == "default-src *" and "referrer-policy" not in other
