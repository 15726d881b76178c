"""An expert-major copy of a model's experts: one contiguous, page-aligned block per expert.

In a stacked checkpoint one expert is 3-9 slices scattered over as many tensors; after repacking
it is a single read. The store uses the copy automatically when its manifest is valid for the
model's current files (see `store.read_manifest`).
"""

from __future__ import annotations

import json
import os
import zlib
from contextlib import nullcontext
from pathlib import Path

import numpy as np

from .files import atomic_write_text
from .store import (REPACK_SCHEMA, StoreError, repack_dir, manifest_checksum, source_digest,
                    weight_files)


def repack(model_dir: str | Path, out: str | Path | None = None, page_size: int = 4096,
           progress=None) -> Path:
    """Write `experts.bin` and `manifest.json` into `out` (default: `store.repack_dir`).

    `progress(items, label)` is a context manager that may wrap the layers (a progress bar).
    """
    model_dir = Path(model_dir)
    out = Path(out) if out else repack_dir(model_dir)
    out.mkdir(parents=True, exist_ok=True)
    from .loader import load_lazy  # mlx builds the plan; importing repack needs no mlx

    _, _, _, store, plan = load_lazy(model_dir, drop_page_cache=False, repacked=False)
    source = source_digest(weight_files(model_dir))  # before the reads: see the end
    layers = []
    tmp = out / "experts.bin.tmp"
    with open(tmp, "wb") as f:
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
        os.fsync(f.fileno())
        size = f.tell()
    if source_digest(weight_files(model_dir)) != source:  # the copy may hold the old bytes
        tmp.unlink()
        raise StoreError(f"{model_dir}: the model files changed while they were repacked: "
                         "repack again")
    os.replace(tmp, out / "experts.bin")
    manifest = {"schema": REPACK_SCHEMA, "version": 1, "page_size": page_size,
                "source": source, "bin_bytes": size,
                "layers": layers}
    manifest["checksum"] = manifest_checksum(manifest)
    atomic_write_text(out / "manifest.json", json.dumps(manifest, indent=1) + "\n")
    return out


def verify(folder: str | Path, model_dir: str | Path | None = None) -> list[str]:
    """Check every expert block against its crc32 and, given `model_dir`, that the model's
    files are still those the copy was made from; returns the problems found (none: valid)."""
    folder = Path(folder)
    try:
        manifest = json.loads((folder / "manifest.json").read_text())
    except FileNotFoundError:
        raise StoreError(f"no repacked copy in {folder}: run `mlx-moestream repack` first") from None
    except (OSError, ValueError) as e:
        raise StoreError(f"{folder / 'manifest.json'}: unreadable repack manifest ({e})") from None
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

