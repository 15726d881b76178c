"""Where each expert's bytes live in a model's safetensors files, and reading them.

Plain Python and numpy (no mlx), so any backend can stream from the same store.
"""

from __future__ import annotations

import fcntl
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# safetensors dtype -> numpy dtype of the raw bytes (bf16 and fp8 are read as raw integers).
RAW_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8,
    "U64": np.uint64, "U32": np.uint32, "U16": np.uint16, "U8": np.uint8,
    "BOOL": np.bool_, "F8_E4M3": np.uint8, "F8_E5M2": np.uint8,
}

# Module projection name -> names the same projection has in per-expert Hugging Face checkpoints.
PER_EXPERT_NAMES = {
    "gate_proj": ("gate_proj", "w1"),
    "up_proj": ("up_proj", "w3"),
    "down_proj": ("down_proj", "w2"),
    "fc1": ("fc1",),
    "fc2": ("fc2",),
}


class StoreError(ValueError):
    """A model's files cannot serve its experts; the message names the file or tensor."""


@dataclass(frozen=True)
class TensorInfo:
    file: int  # index into ExpertStore.files
    dtype: str
    shape: tuple[int, ...]
    offset: int  # absolute byte offset in the file
    nbytes: int


def read_header(path: Path) -> tuple[dict, int]:
    """Parse a safetensors header; returns (header, absolute offset of the data section)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise StoreError(f"{path}: truncated safetensors file ({size} bytes, no header)")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise StoreError(
                f"{path}: header claims {n} bytes but the file has {size}: truncated or corrupt"
            )
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise StoreError(f"{path}: corrupt safetensors header JSON ({e})") from None
    if not isinstance(header, dict):
        raise StoreError(f"{path}: corrupt safetensors header (not a JSON object)")
    return header, 8 + n


def index_file(path: Path, file_id: int) -> dict[str, TensorInfo]:
    """All tensors of one safetensors file, checked against the file's real size."""
    header, data_start = read_header(path)
    size = path.stat().st_size
    tensors = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = meta["dtype"], tuple(meta["shape"]), meta["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise StoreError(f"{path}: corrupt header entry for tensor '{name}'") from None
        if dtype not in RAW_DTYPES:
            raise StoreError(f"{path}: tensor '{name}' has unsupported dtype {dtype}")
        nbytes = end - begin
        expected = int(np.prod(shape, dtype=np.int64)) * np.dtype(RAW_DTYPES[dtype]).itemsize
        if nbytes != expected:
            raise StoreError(
                f"{path}: tensor '{name}' spans {nbytes} bytes but {dtype}{list(shape)} needs {expected}"
            )
        if data_start + end > size:
            raise StoreError(
                f"{path}: truncated: tensor '{name}' ends at byte {data_start + end} "
                f"but the file has {size}"
            )
        tensors[name] = TensorInfo(file_id, dtype, shape, data_start + begin, nbytes)
    return tensors


def weight_files(model_dir: Path) -> list[Path]:
    """The shards mlx-lm would load, in a stable order."""
    files = sorted(model_dir.glob("model*.safetensors"))
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise StoreError(f"{index}: corrupt shard index ({e})") from None
        missing = sorted({f for f in weight_map.values() if not (model_dir / f).exists()})
        if missing:
            raise StoreError(f"{index}: lists shard(s) that do not exist: {', '.join(missing)}")
    if not files:
        raise StoreError(f"{model_dir}: no model*.safetensors files")
    return files


@dataclass
class ExpertTensor:
    """One per-expert tensor of a layer (e.g. `gate_proj.weight`): where expert e's bytes start."""

    name: str
    file: int
    offsets: np.ndarray  # [num_experts] absolute byte offsets
    nbytes: int


class ExpertStore:
    """Index of every shard of a model directory; reads one expert's tensors into given buffers."""

    def __init__(self, model_dir: str | Path, drop_page_cache: bool = True):
        """`drop_page_cache`: after each read, tell the OS not to keep the pages (Linux
        POSIX_FADV_DONTNEED, macOS F_NOCACHE), so cached file pages do not quietly add a second
        copy of the experts on top of the budget."""
        self.model_dir = Path(model_dir)
        self.drop_page_cache = drop_page_cache
        self.files = weight_files(self.model_dir)
        self.tensors: dict[str, TensorInfo] = {}
        for i, path in enumerate(self.files):
            self.tensors.update(index_file(path, i))
        self._fds: list[int] | None = None
        self.layers: list[list[ExpertTensor]] = []

    def add_layer(self, prefix: str, params: dict[str, tuple[tuple[int, ...], int]], num_experts: int) -> int:
        """Locate a MoE layer's expert tensors; returns the layer's index in this store.

        `prefix` is the expert module's parameter path (e.g. `model.layers.3.mlp.switch_mlp`),
        `params` maps its per-expert parameter names (`gate_proj.weight`, ...) to the shape and
        byte size of one expert's slice. Stacked checkpoints hold `{prefix}.{name}` of shape
        [E, ...]; per-expert Hugging Face checkpoints hold `{parent}.experts.{e}.{proj}.{param}`.
        """
        located = []
        for name, (shape, nbytes) in params.items():
            located.append(self._locate(prefix, name, shape, nbytes, num_experts))
        located.sort(key=lambda t: (t.file, t.offsets[0]))
        self.layers.append(located)
        return len(self.layers) - 1

    def _locate(self, prefix, name, shape, nbytes, num_experts) -> ExpertTensor:
        stacked = self.tensors.get(f"{prefix}.{name}")
        if stacked is not None:
            if stacked.shape != (num_experts, *shape):
                raise StoreError(
                    f"{self.files[stacked.file]}: tensor '{prefix}.{name}' has shape "
                    f"{list(stacked.shape)}, expected {[num_experts, *shape]}"
                )
            offsets = stacked.offset + nbytes * np.arange(num_experts, dtype=np.int64)
            return ExpertTensor(name, stacked.file, offsets, nbytes)
        parent = prefix.rsplit(".", 1)[0]
        proj, param = name.split(".", 1)
        for alias in PER_EXPERT_NAMES.get(proj, (proj,)):
            keys = [f"{parent}.experts.{e}.{alias}.{param}" for e in range(num_experts)]
            if keys[0] in self.tensors:
                return self._per_expert(keys, name, shape, nbytes)
        raise StoreError(
            f"{self.model_dir}: expert tensor '{prefix}.{name}' (or its per-expert form "
            f"'{parent}.experts.0.{proj}.{param}') is in no shard"
        )

    def _per_expert(self, keys, name, shape, nbytes) -> ExpertTensor:
        infos = []
        for key in keys:
            info = self.tensors.get(key)
            if info is None:
                raise StoreError(f"{self.model_dir}: expert tensor '{key}' is in no shard")
            if info.shape != tuple(shape):
                raise StoreError(
                    f"{self.files[info.file]}: tensor '{key}' has shape {list(info.shape)}, "
                    f"expected {list(shape)}"
                )
            infos.append(info)
        if len({i.file for i in infos}) != 1:
            # Experts of one tensor split over shards: keep one file per ExpertTensor simple by
            # refusing; no known checkpoint does this.
            raise StoreError(f"{self.model_dir}: experts of '{name}' are split across shards")
        offsets = np.array([i.offset for i in infos], dtype=np.int64)
        return ExpertTensor(name, infos[0].file, offsets, nbytes)

    def open(self) -> None:
        if self._fds is None:
            self._fds = [os.open(p, os.O_RDONLY) for p in self.files]
            if self.drop_page_cache and hasattr(fcntl, "F_NOCACHE"):  # macOS
                for fd in self._fds:
                    fcntl.fcntl(fd, fcntl.F_NOCACHE, 1)

    def close(self) -> None:
        for fd in self._fds or ():
            os.close(fd)
        self._fds = None

    def read_expert(self, layer: int, expert: int, dest: dict[str, np.ndarray]) -> int:
        """Read one expert's tensors (in file order) straight into `dest` buffers; returns bytes."""
        self.open()
        total = 0
        for t in self.layers[layer]:
            buf = memoryview(dest[t.name]).cast("B")
            offset = int(t.offsets[expert])
            got = 0
            while got < t.nbytes:
                try:
                    n = os.preadv(self._fds[t.file], [buf[got:]], offset + got)
                except OSError as e:
                    n, why = 0, e.strerror
                else:
                    why = "unexpected end of file"
                if n == 0:
                    raise StoreError(
                        f"{self.files[t.file]}: cannot read '{t.name}' of layer {layer} "
                        f"expert {expert} at byte {offset + got}: {why}"
                    )
                got += n
            if self.drop_page_cache and hasattr(os, "posix_fadvise"):
                os.posix_fadvise(self._fds[t.file], offset, t.nbytes, os.POSIX_FADV_DONTNEED)
            total += t.nbytes
        return total

