"""A model's safetensors checkpoint: its shards, every tensor's bytes, and each expert's tensors.

Checkpoints of different families keep the same experts under other names: stacked `[E, ...]`
tensors (mlx-community, transformers 5's fused ones, aliases such as Granite's `input_linear`) or
one tensor per expert (Hugging Face's `experts.{e}.w1`). `Checkpoint.locate` finds them all.
Plain Python and numpy (no mlx).
"""

from __future__ import annotations

import json
import os
import re
import struct
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import StoreError
from .files import open_regular, parse_json, read_json

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
    "fc1": ("fc1", "up_proj"),  # Nemotron-H
    "fc2": ("fc2", "down_proj"),
}
# Stacked [E, rows, ...] tensors kept under another name, by the name the module reads.
# Each form is (name under the experts' block, part, parts, interleaved): that tensor holds
# `parts` tensors' rows, this one's being `part`, as blocks one after the other or (interleaved)
# row by row; other dimensions may differ by a view (gpt-oss's u8 blocks of u32 words).
# Granite keeps gate and up as the halves of one `input_linear` (mlx-lm splits it, transformers
# renames it); Aria's text model has transformers' fused tensors as `experts.fc1` / `experts.fc2`;
# gpt-oss's MXFP4 checkpoints alternate gate and up rows.
STACKED_ALIASES = {
    "gate_proj.weight": (("input_linear.weight", 0, 2, False),
                         ("experts.gate_up_proj_blocks", 0, 2, True)),
    "up_proj.weight": (("input_linear.weight", 1, 2, False),
                       ("experts.gate_up_proj_blocks", 1, 2, True)),
    "gate_proj.scales": (("experts.gate_up_proj_scales", 0, 2, True),),
    "up_proj.scales": (("experts.gate_up_proj_scales", 1, 2, True),),
    "gate_proj.bias": (("experts.gate_up_proj_bias", 0, 2, True),),
    "up_proj.bias": (("experts.gate_up_proj_bias", 1, 2, True),),
    "down_proj.weight": (("output_linear.weight", 0, 1, False),
                         ("experts.down_proj_blocks", 0, 1, False)),
    "down_proj.scales": (("experts.down_proj_scales", 0, 1, False),),
    "down_proj.bias": (("experts.down_proj_bias", 0, 1, False),),
    "gate_up_proj": (("input_linear.weight", 0, 1, False), ("experts.fc1.weight", 0, 1, False)),
    "down_proj": (("output_linear.weight", 0, 1, False), ("experts.fc2.weight", 0, 1, False)),
}


@dataclass(frozen=True)
class TensorInfo:
    file: int  # index into the store's files
    dtype: str
    shape: tuple[int, ...]
    offset: int  # absolute byte offset in the file
    nbytes: int


@dataclass
class ExpertTensor:
    """One per-expert tensor of a layer (e.g. `gate_proj.weight`): where expert e's bytes are."""

    name: str
    files: np.ndarray  # [num_experts] index into the store's files
    offsets: np.ndarray  # [num_experts] absolute byte offsets
    nbytes: int
    stacked: bool = False  # the experts follow each other in one file (a stacked tensor)
    # > 0: the expert's `rows` alternate with those of the other tensors of a block of `parts`
    # at `offsets` (gpt-oss's gate and up), this one's rows being `part` of each turn.
    rows: int = 0
    part: int = 0
    parts: int = 1


def read_header(path: Path) -> tuple[dict, int]:
    """Parse a safetensors header.

    Returns:
        The header, and the absolute offset of the data section.
    """
    raw = header_bytes(path)
    header = parse_json(raw, path, "corrupt safetensors header JSON", StoreError)
    if not isinstance(header, dict):
        raise StoreError(f"{path}: corrupt safetensors header (not a JSON object)")
    return header, 8 + len(raw)


def header_bytes(path: Path) -> bytes:
    """A safetensors file's header as stored, its length checked against the file's size."""
    with open_regular(path, "cannot read", StoreError) as f:  # a directory: "cannot read"
        try:
            size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            if len(head) < 8:
                raise StoreError(f"{path}: truncated safetensors file ({size} bytes, no header)")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8:
                raise StoreError(f"{path}: header claims {n} bytes but the file has {size}: "
                                 f"truncated or corrupt")
            return f.read(n)
        except OSError as e:  # a read error of the disk
            raise StoreError(f"{path}: cannot read ({e.strerror or e})") from None


def index_file(path: Path, file_id: int) -> dict[str, TensorInfo]:
    """All tensors of one safetensors file, checked against the file's real size."""
    header, data_start = read_header(path)
    size = path.stat().st_size
    tensors = {}
    for name, meta in header.items():
        if name == "__metadata__":  # null (as mlx writes it) or names to strings
            if meta is not None and not (isinstance(meta, dict)
                                         and all(isinstance(v, str) for v in meta.values())):
                raise StoreError(f"{path}: corrupt header: __metadata__ must map names to strings")
            continue
        try:
            dtype, shape, (begin, end) = meta["dtype"], tuple(meta["shape"]), meta["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise StoreError(f"{path}: corrupt header entry for tensor '{name}'") from None
        numbers = (*shape, begin, end)
        if not all(type(n) is int and n >= 0 for n in numbers) or begin > end:
            raise StoreError(f"{path}: corrupt header entry for tensor '{name}' (shape {shape}, "
                             f"offsets {[begin, end]}: need non-negative integers, begin <= end)")
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
        content = read_json(index, "corrupt shard index", StoreError)
        try:
            weight_map = content["weight_map"]
        except (KeyError, TypeError) as e:
            raise StoreError(f"{index}: corrupt shard index ({type(e).__name__}: {e})") from None
        if not isinstance(weight_map, dict) or not all(isinstance(f, str)
                                                       for f in weight_map.values()):
            raise StoreError(f"{index}: corrupt shard index (weight_map must map tensor names "
                             f"to file names)")
        missing = sorted({f for f in weight_map.values() if not (model_dir / f).exists()})
        if missing:
            raise StoreError(f"{index}: lists shard(s) that do not exist: {', '.join(missing)}")
    if not files:
        raise StoreError(f"{model_dir}: no model*.safetensors files")
    return files


def stat_file(path: Path) -> os.stat_result:
    """`os.stat`, its failure a `StoreError` that names a dangling link as one."""
    try:
        return os.stat(path)
    except OSError as e:
        gone = " (a link to a file that is gone: a download interrupted or cleaned up?)"
        raise StoreError(f"{path}: cannot open: {e.strerror}"
                         + (gone if path.is_symlink() else "")) from None


def file_identity(stat: os.stat_result) -> tuple[int, int, int]:
    """What tells a file rewritten in place: its size, modification and status change time.

    The status change time is there because a write moves it and no user can set it back
    (`touch -d`, `cp -p` and `rsync -t` set the modification time back).
    """
    return stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns


def _stacked_forms(parent: str, name: str) -> dict[str, tuple[int, int, bool]]:
    """Keys an original checkpoint may keep the stacked tensor a module reads as `name` under.

    Returns:
        Each key (transformers 5's fused form, or a `STACKED_ALIASES` name) with its
        (part, parts, interleaved) of every expert's rows.
    """
    return {f"{parent}.experts.{name}": (0, 1, False),
            **{f"{parent}.{alias}": form for alias, *form in STACKED_ALIASES.get(name, ())}}


class Checkpoint:
    """Index of every shard of a model folder, and where each expert's tensors are in it."""

    def __init__(self, model_dir: Path):
        self.model_dir = model_dir
        self.files = weight_files(model_dir)
        # Taken before indexing, so a rewrite even while the headers are read fails every read.
        self.identity = [file_identity(stat_file(path)) for path in self.files]
        self.tensors: dict[str, TensorInfo] = {}
        for i, path in enumerate(self.files):
            for name, info in index_file(path, i).items():
                if name in self.tensors:  # mlx-lm keeps the last in its own order: not ours
                    other = self.files[self.tensors[name].file].name
                    raise StoreError(f"{path}: tensor '{name}' is also in {other}: two "
                                     "checkpoints in one folder? Remove the stale shard")
                self.tensors[name] = info
        self._expert_parents: dict[tuple[str, str], list[str]] | None = None  # see `_parent`

    def locate(self, prefix: str, name: str, shape: tuple[int, ...], nbytes: int,
               num_experts: int) -> ExpertTensor:
        """Find where each expert's `name` tensor of the module at `prefix` is stored.

        Args:
            prefix: The experts module's parameter path (`model.layers.3.mlp.switch_mlp`).
            name: The per-expert parameter the module reads (`gate_proj.weight`).
            shape: One expert's shape of it.
            nbytes: One expert's bytes of it.
            num_experts: The layer's experts.
        """
        parent = prefix.rsplit(".", 1)[0]
        proj, _, param = name.partition(".")  # a fused name (`gate_up_proj`) has no param
        # stacked as mlx-community names them, or as the original checkpoints do
        stacked_keys = {f"{prefix}.{name}": (0, 1, False), **_stacked_forms(parent, name)}
        aliases = PER_EXPERT_NAMES.get(proj, (proj,))
        owners = {alias: self._parent(parent, f"{alias}.{param}") for alias in aliases}
        first_expert = [f"{owners[alias]}.experts.0.{alias}.{param}" for alias in aliases if param]
        forms = [k for k in dict.fromkeys((*stacked_keys, *first_expert)) if k in self.tensors]
        if len(forms) > 1:  # a leftover of another conversion: which one is the model's?
            raise StoreError(
                f"{self.model_dir}: expert tensor '{prefix}.{name}' is stored twice, as "
                + " and as ".join(f"'{k}' ({self.files[self.tensors[k].file].name})"
                                  for k in forms) + ": remove the stale shard")
        key = forms[0] if forms and forms[0] in stacked_keys else None
        stacked = self.tensors.get(key)
        if stacked is not None:
            return self._stacked(key, stacked, stacked_keys[key], name, shape, nbytes,
                                 num_experts)
        for alias in aliases:
            keys = [f"{owners[alias]}.experts.{e}.{alias}.{param}" for e in range(num_experts)]
            if keys[0] in self.tensors:
                return self._per_expert(keys, name, shape, nbytes)
        raise StoreError(
            f"{self.model_dir}: expert tensor '{prefix}.{name}' (or its per-expert form "
            f"'{parent}.experts.0.{proj}.{param}') is in no shard"
            + self._stored_instead(prefix, num_experts)
        )

    def _stacked(self, key: str, stacked: TensorInfo, form: tuple[int, int, bool], name: str,
                 shape: tuple[int, ...], nbytes: int, num_experts: int) -> ExpertTensor:
        """Each expert's slice of the stacked tensor `key`, which holds it in `form`."""
        part, parts, interleaved = form
        want = [num_experts, *shape]
        if parts > 1:  # each expert's rows hold the parts
            want[1] *= parts
        # Reads take rows and bytes: other dimensions may differ by a view, and mlx-lm checks
        # the shapes it gives the model.
        if list(stacked.shape[:2]) != want[:2]:
            raise StoreError(
                f"{self.files[stacked.file]}: tensor '{key}' has shape "
                f"{list(stacked.shape)}, expected {want}"
            )
        if stacked.nbytes != nbytes * parts * num_experts:  # another dtype: reads would be off
            raise StoreError(
                f"{self.files[stacked.file]}: tensor '{key}' is {stacked.dtype} "
                f"({stacked.nbytes // num_experts} bytes per expert) where the model reads "
                f"{nbytes * parts} bytes per expert: convert the experts to the model's dtype"
            )
        files = np.full(num_experts, stacked.file)
        experts = np.arange(num_experts, dtype=np.int64)
        if interleaved:  # its rows alternate with the other parts' rows
            offsets = stacked.offset + nbytes * parts * experts
            return ExpertTensor(name, files, offsets, nbytes, rows=shape[0], part=part,
                                parts=parts)
        offsets = stacked.offset + nbytes * (parts * experts + part)
        return ExpertTensor(name, files, offsets, nbytes, stacked=parts == 1)

    def _stored_instead(self, prefix: str, num_experts: int) -> str:
        """Name, for the error of an expert tensor it lacks, what the checkpoint holds instead.

        That is the tensors of `prefix`'s layer under `experts.`, or of a row per expert and
        more dimensions.
        """
        layer = re.search(r"[^.]+\.\d+\.", prefix)  # `layers.3.`
        if layer is None:
            return ""
        found = sorted(key for key, info in self.tensors.items()
                       if f".{layer[0]}" in f".{key}" and (
                           ".experts." in key
                           or len(info.shape) >= 3 and info.shape[0] == num_experts))
        if not found:
            return ""
        more = f" and {len(found) - 1} more" if len(found) > 1 else ""
        return (f"; for that layer's experts it holds '{found[0]}'{more}: experts the model "
                f"converts at load in another way (a transpose, a dequantization) do not "
                f"stream, a checkpoint converted by mlx_lm.convert does")

    def stacked_key(self, parent: str, name: str) -> str | None:
        """The whole stacked tensor a fused experts module under `parent` reads as `name`.

        Returns:
            Its key (for `gate_up_proj`, say), or None if the checkpoint has none.
        """
        return next((key for key, (_, parts, _) in _stacked_forms(parent, name).items()
                     if parts == 1 and key in self.tensors), None)

    def _parent(self, parent: str, tail: str) -> str:
        """The module whose per-expert tensors `experts.E.{tail}` a module under `parent` reads.

        That is `parent`, or else the one other module of its layer that has them (Kimi-Linear's
        checkpoints keep them in `block_sparse_moe`, which mlx-lm moves to `mlp`).
        """
        if f"{parent}.experts.0.{tail}" in self.tensors:
            return parent
        if self._expert_parents is None:  # per (layer, tail): the modules with such tensors
            self._expert_parents = {}
            for key in self.tensors:
                owner, found, rest = key.partition(".experts.0.")
                if found:
                    layer = owner.rsplit(".", 1)[0]
                    self._expert_parents.setdefault((layer, rest), []).append(owner)
        owners = self._expert_parents.get((parent.rsplit(".", 1)[0], tail), [])
        return owners[0] if len(owners) == 1 else parent

    def _per_expert(self, keys: list[str], name: str, shape: tuple[int, ...],
                    nbytes: int) -> ExpertTensor:
        """The experts' own tensors `keys`, each checked to hold what the model reads. A
        tensor in another dtype than most (the model stacks them in a third, wider one) is
        named before any is compared with the model's size."""
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
        common = Counter(info.dtype for info in infos).most_common(1)[0][0]
        for key, info in zip(keys, infos):
            if info.dtype != common:  # misread
                raise StoreError(
                    f"{self.files[info.file]}: tensor '{key}' is {info.dtype} where the other "
                    f"experts' are {common}: convert the experts to one dtype"
                )
        for key, info in zip(keys, infos):
            if info.nbytes != nbytes:  # read past it
                raise StoreError(
                    f"{self.files[info.file]}: tensor '{key}' is {info.dtype} ({info.nbytes} "
                    f"bytes) where the model reads {nbytes} bytes per expert: the model converts "
                    f"the experts at load (FP8 ones to bfloat16), which the store does not: "
                    f"stream a checkpoint converted by mlx_lm.convert"
                )
        files = np.array([i.file for i in infos])
        offsets = np.array([i.offset for i in infos], dtype=np.int64)
        return ExpertTensor(name, files, offsets, nbytes)
