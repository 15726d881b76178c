"""An expert-major copy of a model's experts: one contiguous, page-aligned block per expert.

In a stacked checkpoint one expert is 3-9 slices scattered over as many tensors; after repacking
it is a single read. The store uses the copy automatically when its manifest is valid for the
model's current files (see `manifest.read_manifest`).
"""

from __future__ import annotations

import json
import os
import zlib
from contextlib import nullcontext, suppress
from pathlib import Path

import numpy as np

from .checkpoint import weight_files
from .errors import StoreError
from .files import atomic_write, atomic_write_text, check_replaceable, read_json
from .manifest import REPACK_SCHEMA, manifest_checksum, read_manifest, repack_dir, source_digest


def repack(model_dir: str | Path, out: str | Path | None = None, page_size: int = 4096,
           progress=None) -> Path:
    """Write `experts.bin` and `manifest.json` into `out` (default: `manifest.repack_dir`).

    `progress(items, label)` is a context manager that may wrap the layers (a progress bar).
    """
    model_dir = Path(model_dir)
    out = Path(out) if out else repack_dir(model_dir)
    _check_out(out)
    from .mlx import load_lazy  # mlx builds the plan; importing repack needs no mlx

    _, _, _, store, plan = load_lazy(model_dir, drop_page_cache=False, repacked=False)
    source = source_digest(weight_files(model_dir))  # before the reads: see the end
    layers = []

    def write(f) -> None:
        items = list(enumerate(plan.layers))
        with (progress(items, "repack") if progress else nullcontext(items)) as bar:
            for i, layer in bar:
                names = sorted(layer.specs)
                sizes = [layer.specs[n][2] for n in names]
                store_layer = store.add_layer(
                    layer.path, {n: (layer.specs[n][0], layer.specs[n][2]) for n in names},
                    layer.num_experts)
                block = sum(sizes)
                stride = -(-block // page_size) * page_size
                offsets = np.cumsum([0, *sizes[:-1]]).tolist()
                buf = np.zeros(stride, np.uint8)
                dest = {n: buf[o:o + s] for n, o, s in zip(names, offsets, sizes)}
                base, crcs = f.tell(), []
                for expert in range(layer.num_experts):
                    store.read_expert(store_layer, expert, dest)
                    crcs.append(zlib.crc32(buf[:block]))
                    f.write(buf)
                layers.append({
                    "name": layer.path, "offset": base, "stride": stride,
                    "tensors": [{"name": n, "offset": o, "nbytes": s}
                                for n, o, s in zip(names, offsets, sizes)],
                    "crc32": crcs,
                })
        f.flush()
        os.fsync(f.fileno())  # the copy is complete: a change of the files from now on
        if source_digest(weight_files(model_dir)) != source:  # means it may hold old bytes
            raise StoreError(f"{model_dir}: the model files changed while they were repacked: "
                             "repack again")

    # An interrupted or failed repack leaves nothing behind: not the folder it made, and not
    # an experts.bin without its manifest, which every later repack would refuse to replace.
    # What it wrote is told by identity (a rename brings a new file), not by a flag set after
    # the rename, which an interrupt could fall between.
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    before = {name: _inode(out / name) for name in ("experts.bin", "manifest.json")}
    try:
        atomic_write(out / "experts.bin", write)
        manifest = {"schema": REPACK_SCHEMA, "version": 1, "page_size": page_size,
                    "source": source, "bin_bytes": (out / "experts.bin").stat().st_size,
                    "layers": layers}
        manifest["checksum"] = manifest_checksum(manifest)
        atomic_write_text(out / "manifest.json", json.dumps(manifest, indent=1) + "\n")
    except BaseException:
        if _inode(out / "manifest.json") == before["manifest.json"]:  # else it is complete
            with suppress(OSError):
                if _inode(out / "experts.bin") != before["experts.bin"]:
                    (out / "experts.bin").unlink()
                if created:
                    out.rmdir()
        raise
    return out


def _inode(path: Path) -> tuple[int, int] | None:
    try:
        stat = os.stat(path)
    except OSError:
        return None
    return stat.st_dev, stat.st_ino


def _check_out(out: Path) -> None:
    """Write only where a repack wrote before, if anything is there: never over a
    manifest.json or experts.bin that is not a repacked copy's."""
    manifest = out / "manifest.json"
    if out.is_dir():  # (else made later) a folder it cannot write in is refused here too
        check_replaceable(manifest, _read_schema, "a repack manifest", StoreError)
    if not os.path.lexists(manifest) and (out / "experts.bin").exists():
        raise StoreError(f"refusing to replace {out / 'experts.bin'}: no repack manifest "
                         "beside it")


def _read_schema(manifest: Path) -> None:
    content = read_json(manifest, "not a repack manifest")
    if not isinstance(content, dict) or content.get("schema") != REPACK_SCHEMA:
        raise ValueError("not a repack manifest")


def verify(folder: str | Path, model_dir: str | Path | None = None) -> list[str]:
    """Check the manifest as a load does (see `manifest.read_manifest`), every expert block
    against its crc32 and, given `model_dir`, that the model's files are still those the copy
    was made from; returns the problems found (none: valid)."""
    folder = Path(folder)
    if not (folder / "manifest.json").exists():
        raise StoreError(f"no repacked copy in {folder}: run `mlx-moestream repack` first")
    try:
        manifest = read_manifest(folder, None)
    except StoreError as e:
        return [str(e)]  # a load ignores the copy
    problems = []
    if model_dir is not None and manifest["source"] != source_digest(weight_files(Path(model_dir))):
        problems.append(f"{folder}: made from other model files (repack again)")
    with open(folder / "experts.bin", "rb") as f:
        for layer in manifest["layers"]:
            block = sum(t["nbytes"] for t in layer["tensors"])
            for expert, crc in enumerate(layer["crc32"]):
                f.seek(layer["offset"] + expert * layer["stride"])
                if zlib.crc32(f.read(block)) != crc:
                    problems.append(f"{layer['name']} expert {expert}: checksum mismatch")
    return problems
