#!/usr/bin/env python3
"""Fetches the web UI's third-party files from the npm registry at pinned versions into
qwenserve/entrypoints/openai/webui/vendor/: each library's browser build, its license, the licenses of the
packages its build bundles, and manifest.json (package, version, source path and SHA-256 of every file), which
tests/test_web_ui_files.py checks. The files are committed: the UI works offline, with no CDN and no build step.

    python3 scripts/vendor_webui.py    # needs `npm` (it runs `npm pack`, which checks the registry's integrity)

To upgrade, change a version below, run it, and run the web UI tests."""
from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

VENDOR = Path(__file__).resolve().parent.parent / "qwenserve" / "entrypoints" / "openai" / "webui" / "vendor"

# package, exact version, {path in the package: name under vendor/}
PACKAGES = [
    ("markdown-it", "15.0.3", {"dist/browser/markdown-it.umd.min.js": "markdown-it.min.js",
                               "LICENSE": "markdown-it.LICENSE"}),
    ("dompurify", "3.5.0", {"dist/purify.min.js": "purify.min.js", "LICENSE": "dompurify.LICENSE"}),
    # bundled into markdown-it.min.js: their licenses travel with it (versions: markdown-it's dependency ranges)
    ("entities", "8.1.0", {"LICENSE": "entities.LICENSE"}),
    ("linkify-it", "6.1.0", {"LICENSE": "linkify-it.LICENSE"}),
    ("mdurl", "2.1.0", {"LICENSE": "mdurl.LICENSE"}),
    ("punycode.js", "2.3.1", {"LICENSE-MIT.txt": "punycode.js.LICENSE"}),
    ("uc.micro", "3.0.0", {"LICENSE.txt": "uc.micro.LICENSE"}),
]


def fetch(package: str, version: str, files: dict[str, str], work: Path) -> list[dict]:
    subprocess.run(["npm", "pack", f"{package}@{version}", "--silent", "--pack-destination", str(work)],
                   check=True, stdout=subprocess.DEVNULL)
    tgz = next(work.glob(f"{package.replace('/', '-')}-{version}.tgz"))
    root = work / f"{package}-{version}"
    with tarfile.open(tgz) as tar:
        tar.extractall(root, filter="data")
    entries = []
    for source, name in files.items():
        data = (root / "package" / source).read_bytes()
        (VENDOR / name).write_bytes(data)
        entries.append({"file": name, "package": package, "version": version, "source": source,
                        "sha256": hashlib.sha256(data).hexdigest()})
    return entries


def main() -> int:
    if shutil.which("npm") is None:
        print("npm not found: install Node.js and npm", file=sys.stderr)
        return 1
    if VENDOR.exists():
        shutil.rmtree(VENDOR)
    VENDOR.mkdir(parents=True)
    entries = []
    with tempfile.TemporaryDirectory() as tmp:
        for package, version, files in PACKAGES:
            entries += fetch(package, version, files, Path(tmp))
    (VENDOR / "manifest.json").write_text(json.dumps({"files": entries}, indent=1) + "\n")
    for e in entries:
        print(f"{e['sha256']}  {e['file']}  ({e['package']}@{e['version']} {e['source']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
