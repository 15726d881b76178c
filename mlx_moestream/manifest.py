"""A repacked copy's manifest: where the copy lives, its checksums, and what it was made from.

`repack` writes the copy (`experts.bin`) and its `manifest.json`; a load uses the copy only when
the manifest checks out against the model's current shards.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np

from .checkpoint import ExpertTensor, file_identity, header_bytes
from .errors import StoreError
from .files import read_json

REPACK_DIR = "moestream-experts"
REPACK_SCHEMA = "mlx-moestream-repack"


def repack_dir(model_dir: Path) -> Path:
    """Where `repack` writes a model's copy.

    That is MODEL/moestream-experts, or, for a model folder that is not writable or ships inside
    this package (the embedded model), a folder of the user cache named after its resolved path.
    """
    model_dir = Path(model_dir).resolve()
    package = Path(__file__).resolve().parent
    if os.access(model_dir, os.W_OK) and package not in model_dir.parents:
        return model_dir / REPACK_DIR
    return _cached_copy(model_dir)


def _cached_copy(model_dir: Path) -> Path:
    key = hashlib.sha256(str(model_dir).encode()).hexdigest()[:16]
    return Path.home() / ".cache" / "mlx-moestream" / "repacked" / f"{model_dir.name}-{key}"


def find_repacked(model_dir: Path) -> Path:
    """Where a load looks for a model's copy.

    That is where `repack` writes it, else where it wrote it before the model folder was made
    read-only (MODEL/moestream-experts) or writable (the user cache's).
    """
    folder = repack_dir(model_dir)
    model_dir = Path(model_dir).resolve()
    for found in (folder, model_dir / REPACK_DIR, _cached_copy(model_dir)):
        if (found / "manifest.json").exists():
            return found
    return folder


def packed_tensors(layer: dict, file: int, num_experts: int) -> list[ExpertTensor]:
    """Where each expert's tensors are in the copy, from the manifest's entry for its `layer`.

    Args:
        file: The copy's index among the store's files.
    """
    experts = np.arange(num_experts, dtype=np.int64)
    files = np.full(num_experts, file)
    starts = layer["offset"] + experts * layer["stride"]
    return [ExpertTensor(t["name"], files, starts + t["offset"], t["nbytes"])
            for t in layer["tensors"]]


def source_digest(files: list[Path]) -> list[dict]:
    """What a repacked copy must still match: each shard's name, `file_identity` and header hash.

    A shard rewritten in place after the repack has a new status change time, whatever its
    modification time says.
    """
    out = []
    for path in files:
        header = header_bytes(path)
        size, mtime_ns, ctime_ns = file_identity(path.stat())
        out.append({"file": path.name, "bytes": size, "mtime_ns": mtime_ns,
                    "ctime_ns": ctime_ns, "header_sha256": hashlib.sha256(header).hexdigest()})
    return out


def manifest_checksum(manifest: dict) -> str:
    """The sha256 of the manifest's fields but `checksum`, which holds it."""
    body = {k: v for k, v in manifest.items() if k != "checksum"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def read_manifest(folder: Path, files: list[Path] | None) -> dict:
    """A repacked copy's manifest, checked as a load opens it.

    Args:
        folder: The copy's folder.
        files: The model's shards, which the copy must have been made from; None skips that.

    Returns:
        The manifest, once its own checksum and the size of `experts.bin` check out.
    """
    path = folder / "manifest.json"
    manifest = read_json(path, "unreadable repack manifest", StoreError)
    if (not isinstance(manifest, dict) or manifest.get("schema") != REPACK_SCHEMA
            or manifest.get("checksum") != manifest_checksum(manifest)
            or not {"bin_bytes", "source", "layers"} <= manifest.keys()):
        raise StoreError(f"{path}: corrupt repack manifest (checksum mismatch or missing fields)")
    binary = folder / "experts.bin"
    if not binary.exists() or binary.stat().st_size != manifest["bin_bytes"]:
        raise StoreError(f"{binary}: missing or not {manifest['bin_bytes']} bytes")
    if files is not None and manifest["source"] != source_digest(files):
        if not all("ctime_ns" in shard for shard in manifest["source"]):
            raise StoreError(f"{path}: made by an earlier mlx-moestream, which did not record "
                             f"what now tells the model files unchanged (repack again)")
        raise StoreError(f"{path}: made from other model files (repack again)")
    return manifest
