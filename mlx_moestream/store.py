"""Where each expert's bytes live in a model's safetensors files, and reading them.

Plain Python and numpy (no mlx), so any backend can stream from the same store.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import mmap
import os
import re
import struct
import threading
import time
import warnings
import weakref
import zlib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import numpy as np

from .errors import StoreError

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
# Stacked [E, rows, ...] tensors checkpoints keep under another name, by the name the module
# reads: (name under the experts' block, part, parts, interleaved), the tensor holding `parts`
# tensors' rows of which this is `part`, as blocks one after the other or (`interleaved`)
# row by row; other dimensions may differ by a view (gpt-oss's u8 blocks of u32 words).
# Granite keeps gate and up as the halves of one `input_linear` (mlx-lm splits it,
# transformers renames it); Aria's text model has transformers' fused tensors as
# `experts.fc1` / `experts.fc2`; gpt-oss's MXFP4 checkpoints alternate gate and up rows.
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


REPACK_DIR = "moestream-experts"
# Reading every expert at load (`plan_reads`): one read covers at most this many bytes (macOS
# fails reads past 2 GiB, and several reads let several threads share a file), and a gap of
# other tensors between two expert tensors is read into scratch, not skipped, up to this many
# bytes: a separate read costs a device round trip, worth a few hundred KB at disk speed.
READ_RUN_BYTES = 8 * 2**20
READ_GAP_BYTES = 256 * 2**10
# Reads are dropped from the page cache in windows of this size, the largest folio the page
# cache may hold (2 MiB on x86-64; more on arm64 with 16 or 64 KiB pages): the kernel drops
# only whole folios in a range. Reads without readahead (POSIX_FADV_RANDOM) cache single pages,
# but a file just written (a download, a conversion, a copy) or read by another program is
# cached in large folios, which a drop of an expert's own pages would leave whole.
try:
    DROP_ALIGN = max(2 * 2**20, int(Path("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size")
                                    .read_text()))
except (OSError, ValueError):
    DROP_ALIGN = 2 * 2**20
# a failed read's windows are dropped again for this long: what it requested may still arrive
FAILED_DROP_SECONDS = 1.0
# buffers one preadv takes (Linux and macOS: 1024)
IOV_MAX = os.sysconf("SC_IOV_MAX") if "SC_IOV_MAX" in getattr(os, "sysconf_names", {}) else 1024
REPACK_SCHEMA = "mlx-moestream-repack"


def repack_dir(model_dir: Path) -> Path:
    """Where `repack` writes a model's copy: MODEL/moestream-experts, or, for a model folder that
    is not writable or ships inside this package (the embedded model), a folder of the user
    cache named after the model's resolved path."""
    model_dir = Path(model_dir).resolve()
    package = Path(__file__).resolve().parent
    if os.access(model_dir, os.W_OK) and package not in model_dir.parents:
        return model_dir / REPACK_DIR
    return _cached_copy(model_dir)


def _cached_copy(model_dir: Path) -> Path:
    key = hashlib.sha256(str(model_dir).encode()).hexdigest()[:16]
    return Path.home() / ".cache" / "mlx-moestream" / "repacked" / f"{model_dir.name}-{key}"


def find_repacked(model_dir: Path) -> Path:
    """Where a load looks for a model's copy: where `repack` writes it, else where it wrote it
    before the model folder was made read-only (MODEL/moestream-experts) or writable (the
    user cache's)."""
    folder = repack_dir(model_dir)
    model_dir = Path(model_dir).resolve()
    for found in (folder, model_dir / REPACK_DIR, _cached_copy(model_dir)):
        if (found / "manifest.json").exists():
            return found
    return folder



@dataclass(frozen=True)
class TensorInfo:
    file: int  # index into ExpertStore.files
    dtype: str
    shape: tuple[int, ...]
    offset: int  # absolute byte offset in the file
    nbytes: int


def read_header(path: Path) -> tuple[dict, int]:
    """Parse a safetensors header; returns (header, absolute offset of the data section)."""
    raw = header_bytes(path)
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise StoreError(f"{path}: corrupt safetensors header JSON ({e})") from None
    if not isinstance(header, dict):
        raise StoreError(f"{path}: corrupt safetensors header (not a JSON object)")
    return header, 8 + len(raw)


def header_bytes(path: Path) -> bytes:
    """A safetensors file's header as stored, its length checked against the file's size."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise StoreError(f"{path}: truncated safetensors file ({size} bytes, no header)")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8:
                raise StoreError(f"{path}: header claims {n} bytes but the file has {size}: "
                                 f"truncated or corrupt")
            return f.read(n)
    except OSError as e:  # a directory, a symlink loop, no permission
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


def _stacked_forms(parent: str, name: str) -> dict[str, tuple[int, int, bool]]:
    """Keys a stacked tensor a module under `parent` reads as `name` may have in an original
    checkpoint, each with its (part, parts, interleaved) of every expert's rows: fused as
    transformers 5 saves them, or under a `STACKED_ALIASES` name."""
    return {f"{parent}.experts.{name}": (0, 1, False),
            **{f"{parent}.{alias}": form for alias, *form in STACKED_ALIASES.get(name, ())}}


def _page_aligned(array: np.ndarray) -> bool:
    return array.ctypes.data % mmap.PAGESIZE == 0 and array.flags.c_contiguous


def _stat(path: Path) -> os.stat_result:
    try:
        return os.stat(path)
    except OSError as e:
        gone = " (a link to a file that is gone: a download interrupted or cleaned up?)"
        raise StoreError(f"{path}: cannot open: {e.strerror}"
                         + (gone if path.is_symlink() else "")) from None


def _identity(stat: os.stat_result) -> tuple[int, int, int]:
    """What tells a file rewritten in place: its size and modification time, and its status
    change time, which a write moves and no user can set back (`touch -d`, `cp -p` and
    `rsync -t` set the modification time back)."""
    return stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


def weight_files(model_dir: Path) -> list[Path]:
    """The shards mlx-lm would load, in a stable order."""
    files = sorted(model_dir.glob("model*.safetensors"))
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError, OSError, UnicodeDecodeError) as e:
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


def source_digest(files: list[Path]) -> list[dict]:
    """Name, `_identity` and header hash of each shard: what a repacked copy must still match.
    A shard rewritten in place after the repack has a new status change time, whatever its
    modification time says."""
    out = []
    for path in files:
        header = header_bytes(path)
        size, mtime_ns, ctime_ns = _identity(path.stat())
        out.append({"file": path.name, "bytes": size, "mtime_ns": mtime_ns,
                    "ctime_ns": ctime_ns, "header_sha256": hashlib.sha256(header).hexdigest()})
    return out


def manifest_checksum(manifest: dict) -> str:
    body = {k: v for k, v in manifest.items() if k != "checksum"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def read_manifest(folder: Path, files: list[Path] | None) -> dict:
    """A repacked copy's manifest, checked at open: its own checksum, the size of experts.bin,
    and (given `files`) that the model's shards are still the ones it was made from."""
    path = folder / "manifest.json"
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:  # not JSON, or not even UTF-8
        raise StoreError(f"{path}: unreadable repack manifest ({e})") from None
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


@dataclass
class Run:
    """One read of a full-budget load: a span of one file holding expert tensors (or pieces of
    them) that land in their buffers, and small gaps between them that land in scratch."""

    file: int
    offset: int
    nbytes: int = 0  # the span, gaps included
    # (offset, store layer, tensor name, buffer) of each piece, in file order
    pieces: list[tuple[int, int, str, memoryview]] = field(default_factory=list)

    def where(self, byte: int) -> str:
        """What a read that failed at absolute `byte` was reading."""
        for offset, layer, name, buf in self.pieces:
            if byte < offset + len(buf):
                return f"'{name}' of layer {layer}"
        return "expert tensors"


@dataclass
class ExpertTensor:
    """One per-expert tensor of a layer (e.g. `gate_proj.weight`): where expert e's bytes are."""

    name: str
    files: np.ndarray  # [num_experts] index into ExpertStore.files
    offsets: np.ndarray  # [num_experts] absolute byte offsets
    nbytes: int
    stacked: bool = False  # the experts follow each other in one file (a stacked tensor)
    # > 0: the expert's `rows` alternate with those of the other tensors of a block of
    # `parts` at `offsets` (gpt-oss's gate and up), this one's rows being `part` of each turn
    rows: int = 0
    part: int = 0
    parts: int = 1


class ExpertStore:
    """Index of every shard of a model directory; reads one expert's tensors into given buffers."""

    def __init__(self, model_dir: str | Path, drop_page_cache: bool = True,
                 repacked: str | Path | bool | None = None):
        """`drop_page_cache`: tell the OS not to keep the pages read (Linux POSIX_FADV_DONTNEED
        once no read of them is in progress, macOS F_NOCACHE), so cached file pages do not
        quietly add a second copy of the experts on top of the budget. `repacked`: an
        expert-major copy made by `repack` (default: `find_repacked(model_dir)` when present;
        False: none); used when its manifest is valid, else ignored with a warning."""
        self.model_dir = Path(model_dir)
        self.drop_page_cache = drop_page_cache
        # pages read are dropped by posix_fadvise (Linux; macOS reads them uncached)
        self._drops = drop_page_cache and hasattr(os, "posix_fadvise")
        self.files = weight_files(self.model_dir)
        # what each file was before it was indexed: a read checks the file still is (see
        # `_read_run`), so a rewrite even while the headers are read fails every read of it
        self.identity = [_identity(_stat(path)) for path in self.files]
        self.tensors: dict[str, TensorInfo] = {}
        for i, path in enumerate(self.files):
            for name, info in index_file(path, i).items():
                if name in self.tensors:  # mlx-lm keeps the last in its own order: not ours
                    other = self.files[self.tensors[name].file].name
                    raise StoreError(f"{path}: tensor '{name}' is also in {other}: two "
                                     "checkpoints in one folder? Remove the stale shard")
                self.tensors[name] = info
        self._fds: list[int] | None = None
        self._direct: int | None = None  # experts.bin opened with O_DIRECT, when it can be
        self._closer: weakref.finalize | None = None  # closes what `open` opened
        self._bounce = threading.local()  # each reader thread's page-aligned buffer
        self._reads_lock = threading.Lock()
        # (file, window): how many `_read_parts` in progress read it, on any thread
        self._in_flight: dict[tuple[int, int], int] = {}
        # windows read and not yet dropped -> until when to drop them again (a failed read's)
        self._undropped: dict[tuple[int, int], float] = {}
        self._expert_parents: dict[tuple[str, str], list[str]] | None = None  # see `_parent`
        self.layers: list[list[ExpertTensor]] = []
        self.alternating: list[list[list[ExpertTensor]]] = []  # per layer, those of each block
        self.blocks: list[tuple[int, int] | None] = []  # (offset, stride) of repacked layers
        # per repacked layer, each expert block's crc32, and whether this session checked it
        self.checksums: list[np.ndarray | None] = []
        self.verified: list[np.ndarray | None] = []
        self.repacked: dict[str, dict] = {}
        folder = Path(repacked) if repacked else find_repacked(self.model_dir)
        if repacked or (repacked is None and (folder / "manifest.json").exists()):
            try:
                manifest = read_manifest(folder, self.files)
            except StoreError as e:
                warnings.warn(f"ignoring the repacked experts: {e}", stacklevel=2)
            else:
                binary = folder / "experts.bin"
                self.files.append(binary)
                self.identity.append(_identity(binary.stat()))  # its blocks have crc32s too
                self.repacked = {layer["name"]: layer for layer in manifest["layers"]}

    def add_layer(self, prefix: str, params: dict[str, tuple[tuple[int, ...], int]], num_experts: int,
                  share: range | None = None) -> int:
        """Locate a MoE layer's expert tensors; returns the layer's index in this store.

        `prefix` is the expert module's parameter path (e.g. `model.layers.3.mlp.switch_mlp`),
        `params` maps its per-expert parameter names (`gate_proj.weight`, ...) to the shape and
        byte size of one expert's slice. Stacked checkpoints hold `{prefix}.{name}` of shape
        [E, ...]; per-expert Hugging Face checkpoints hold `{parent}.experts.{e}.{proj}.{param}`.
        `share` serves only those of the layer's `num_experts` (a host's experts): the layer's
        expert i is then `share[i]`.
        """
        packed = self.repacked.get(prefix)
        sizes = {name: nbytes for name, (_, nbytes) in params.items()}
        if packed and {t["name"]: t["nbytes"] for t in packed["tensors"]} == sizes:
            experts = np.arange(num_experts, dtype=np.int64)
            bin_file = np.full(num_experts, len(self.files) - 1)
            located = [ExpertTensor(t["name"], bin_file,
                                    packed["offset"] + t["offset"] + experts * packed["stride"],
                                    t["nbytes"]) for t in packed["tensors"]]
            self.blocks.append((packed["offset"], packed["stride"]))
            self.checksums.append(np.array(packed["crc32"], np.uint32))
            self.verified.append(np.zeros(num_experts, np.bool_))
        else:
            located = [self._locate(prefix, name, shape, nbytes, num_experts)
                       for name, (shape, nbytes) in params.items()]
            self.blocks.append(None)
            self.checksums.append(None)
            self.verified.append(None)
        if share is not None:
            part = slice(share.start, share.stop)
            located = [replace(t, files=t.files[part], offsets=t.offsets[part]) for t in located]
            for per_expert in (self.checksums, self.verified):
                if per_expert[-1] is not None:
                    per_expert[-1] = per_expert[-1][part]
            if self.blocks[-1] is not None:  # a repacked block is found from expert 0's
                offset, stride = self.blocks[-1]
                self.blocks[-1] = (offset + share.start * stride, stride)
        self.layers.append(located)
        blocks: dict[tuple[int, int], list[ExpertTensor]] = {}
        for t in located:
            if t.rows:
                blocks.setdefault((int(t.files[0]), int(t.offsets[0])), []).append(t)
        self.alternating.append(list(blocks.values()))
        return len(self.layers) - 1

    def _locate(self, prefix, name, shape, nbytes, num_experts) -> ExpertTensor:
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
            part, parts, interleaved = stacked_keys[key]
            want = [num_experts, *shape]
            if parts > 1:  # each expert's rows hold the parts
                want[1] *= parts
            # reads take rows and bytes: other dimensions may differ by a view (gpt-oss's u8
            # blocks of u32 words), and mlx-lm checks the shapes it gives the model
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
        for alias in aliases:
            keys = [f"{owners[alias]}.experts.{e}.{alias}.{param}" for e in range(num_experts)]
            if keys[0] in self.tensors:
                return self._per_expert(keys, name, shape, nbytes)
        raise StoreError(
            f"{self.model_dir}: expert tensor '{prefix}.{name}' (or its per-expert form "
            f"'{parent}.experts.0.{proj}.{param}') is in no shard"
            + self._stored_instead(prefix, num_experts)
        )

    def _stored_instead(self, prefix: str, num_experts: int) -> str:
        """What the checkpoint holds for the experts of `prefix`'s layer (tensors under
        `experts.`, or of a row per expert and more dimensions), for the error of an expert
        tensor it lacks."""
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
        """The checkpoint's whole stacked tensor a fused experts module under `parent` reads
        as `name` (`gate_up_proj`), if the checkpoint has one."""
        return next((key for key, (_, parts, _) in _stacked_forms(parent, name).items()
                     if parts == 1 and key in self.tensors), None)

    def _parent(self, parent: str, tail: str) -> str:
        """The module whose per-expert tensors `experts.E.{tail}` a module under `parent` reads:
        `parent`, or else the one other module of its layer that has them (Kimi-Linear's
        checkpoints keep them in `block_sparse_moe`, which mlx-lm moves to `mlp`)."""
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
            first = infos[0] if infos else info
            if info.dtype != first.dtype:  # misread
                raise StoreError(
                    f"{self.files[info.file]}: tensor '{key}' is {info.dtype} where the first "
                    f"expert's is {first.dtype}: convert the experts to one dtype"
                )
            if info.nbytes != nbytes:  # read past it
                raise StoreError(
                    f"{self.files[info.file]}: tensor '{key}' is {info.dtype} ({info.nbytes} "
                    f"bytes) where the model reads {nbytes} bytes per expert: the model converts "
                    f"the experts at load (FP8 ones to bfloat16), which the store does not: "
                    f"stream a checkpoint converted by mlx_lm.convert"
                )
            infos.append(info)
        files = np.array([i.file for i in infos])
        offsets = np.array([i.offset for i in infos], dtype=np.int64)
        return ExpertTensor(name, files, offsets, nbytes)

    def open(self) -> None:
        """Open the files, once (reader threads share the descriptors). They close at `close`
        or when the store is collected (a load refused after this, a model dropped)."""
        if self._fds is not None:
            return
        fds: list[int] = []  # every descriptor, the direct one last
        closer = weakref.finalize(self, _close_all, fds)
        closer.atexit = False  # at exit a daemon thread may still read: the OS closes them
        try:
            for path in self.files:
                fds.append(os.open(path, os.O_RDONLY))
                if self.drop_page_cache and hasattr(fcntl, "F_NOCACHE"):  # macOS
                    fcntl.fcntl(fds[-1], fcntl.F_NOCACHE, 1)
                elif self.drop_page_cache and hasattr(os, "POSIX_FADV_RANDOM"):
                    # no readahead: what it brings may land after the read's pages are
                    # dropped, and stay cached; every read names the bytes it needs
                    os.posix_fadvise(fds[-1], 0, 0, os.POSIX_FADV_RANDOM)
        except BaseException:
            closer()
            raise
        direct = None
        if self.drop_page_cache and self.repacked and hasattr(os, "O_DIRECT"):
            try:  # a file system without direct I/O fails here: read through the cache
                direct = os.open(self.files[-1], os.O_RDONLY | os.O_DIRECT)
                fds.append(direct)
                os.preadv(direct, [mmap.mmap(-1, mmap.PAGESIZE)], 0)
            except OSError:
                if direct is not None:
                    os.close(fds.pop())
                direct = None
        self._fds, self._direct, self._closer = fds[: len(self.files)], direct, closer

    def close(self) -> None:
        if self._fds is not None:
            try:
                with self._reads_lock:
                    self._drop(list(self._undropped))
                    self._undropped.clear()
            finally:
                self._closer()
        self._fds = self._direct = None

    def forked(self) -> None:
        """In a child forked while the store is in use (`Runtime.forked` calls it first): the
        reads in progress at the fork never end here, and one of their threads may have held
        the lock."""
        self._reads_lock = threading.Lock()
        self._in_flight = {}

    def read_expert(self, layer: int, expert: int, dest: dict[str, np.ndarray]) -> int:
        """Read one expert's tensors straight into `dest` buffers, in file order, with one
        preadv per run of contiguous tensors (one per expert in a repacked store; on Linux
        that one is direct I/O, see `_read_block`)."""
        self.open()
        if self.blocks[layer] is None:
            return self._read_parts(layer, expert, dest)
        if self._direct is not None:
            nbytes = self._read_block(layer, expert, dest)
        else:
            nbytes = self._read_parts(layer, expert, dest)
        if not self.verified[layer][expert]:
            self._verify(layer, expert, dest)
        return nbytes

    def expert_major(self, layer: int) -> bool:
        """Whether `layer` is read expert by expert: from the repacked copy (direct I/O), or
        with rows interleaved with another tensor's (through a buffer)."""
        return self.blocks[layer] is not None or bool(self.alternating[layer])

    def plan_reads(self, dests: dict[int, dict[str, np.ndarray]]) -> list[Run]:
        """Reads of every expert of the layers in `dests` (store layer -> its [experts, ...]
        buffers, one per tensor; not `expert_major` ones) in file order: as few and as large as
        `READ_RUN_BYTES`, `READ_GAP_BYTES` and `IOV_MAX` allow. A stacked tensor is one piece,
        a per-expert checkpoint's tensors one each; checkpoints place tensors in any order, so
        a layer's are scattered among other layers' and dense ones."""
        pieces = []
        for layer, dest in dests.items():
            for t in self.layers[layer]:
                whole = memoryview(dest[t.name]).cast("B")
                if t.stacked:
                    parts = [(int(t.files[0]), int(t.offsets[0]), whole)]
                else:
                    parts = [(int(f), int(o), whole[e * t.nbytes : (e + 1) * t.nbytes])
                             for e, (f, o) in enumerate(zip(t.files, t.offsets))]
                for file, offset, buf in parts:
                    for at in range(0, len(buf), READ_RUN_BYTES):  # larger than a run: cut
                        pieces.append((file, offset + at, layer, t.name,
                                       buf[at : at + READ_RUN_BYTES]))
        pieces.sort(key=lambda p: p[:2])
        runs: list[Run] = []
        for file, offset, layer, name, buf in pieces:
            run = runs[-1] if runs else None
            if (run is None or run.file != file
                    or not 0 <= offset - (run.offset + run.nbytes) <= READ_GAP_BYTES
                    or offset + len(buf) - run.offset > READ_RUN_BYTES
                    or 2 * len(run.pieces) + 2 > IOV_MAX):  # a piece and a gap each
                run = Run(file, offset)
                runs.append(run)
            run.pieces.append((offset, layer, name, buf))
            run.nbytes = offset + len(buf) - run.offset
        return runs

    def read_run(self, run: Run) -> None:
        """One read of `plan_reads`: the pieces into their buffers, the gaps into scratch."""
        self.open()
        bufs, at, scratch = [], run.offset, None
        for offset, _, _, buf in run.pieces:
            if offset > at:
                if scratch is None:
                    scratch = memoryview(bytearray(READ_GAP_BYTES))
                bufs.append(scratch[: offset - at])
            bufs.append(buf)
            at = offset + len(buf)
        self._read_run(run.file, run.offset, bufs, run.nbytes, run.where)
        if self._drops:  # the gaps' pages stay: they
            fd = self._fds[run.file]  # hold dense weights, which the model reads next
            for offset, _, _, buf in run.pieces:
                os.posix_fadvise(fd, offset, len(buf), os.POSIX_FADV_DONTNEED)

    def fingerprint(self, samples: int = 16, sample_bytes: int = 4096,
                    small_bytes: int = 4 << 20) -> bytes:
        """A digest of the checkpoint's files: names, sizes, `samples` blocks spread over
        each, and every tensor of at most `small_bytes` whole. Two hosts with another
        fine-tune, quantization or seed under the same path differ in the blocks (almost
        surely in every one); a checkpoint that fixed a router or a norm differs in that small
        tensor alone (a few MiB per layer at most to read)."""
        self.open()
        digest = hashlib.sha256()
        originals = self.files[: len(self.files) - bool(self.repacked)]  # not experts.bin
        small: dict[int, list[tuple[int, int]]] = {}
        for t in self.tensors.values():
            if t.nbytes <= small_bytes:
                small.setdefault(t.file, []).append((t.offset, t.nbytes))
        for file, (path, fd) in enumerate(zip(originals, self._fds)):
            size = os.fstat(fd).st_size
            digest.update(f"{path.name}:{size}".encode())
            for i in range(samples):
                digest.update(os.pread(fd, sample_bytes, i * max(size - sample_bytes, 0)
                                       // max(samples - 1, 1)))
            for offset, nbytes in sorted(small.get(file, ())):
                digest.update(os.pread(fd, nbytes, offset))
        return digest.digest()

    def loaded(self) -> None:
        """Once a load has read what it needs (experts and dense weights): the files must
        still be those indexed, or the dense weights came from other bytes than the experts
        will (a shard replaced or rewritten meanwhile: a download or a sync finishing). Then
        their pages are dropped from the OS cache (Linux): reads in runs leave their gaps
        cached for the dense weights, and readahead of concurrent reads caches past their
        edges."""
        for path, identity in zip(self.files, self.identity):
            if _identity(_stat(path)) != identity:
                raise StoreError(f"{path}: changed on disk while the model loaded (size, "
                                 f"modification or status change time): load it again")
        if self._drops and self._fds is not None:
            for fd in self._fds:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def _verify(self, layer: int, expert: int, dest: dict[str, np.ndarray]) -> None:
        """A repacked expert's first read in a session is checked against the crc32 recorded
        at repack (about 0.2 ms per MiB here): a corrupt block is an error, never an input."""
        crc = 0
        for t in sorted(self.layers[layer], key=lambda t: int(t.offsets[expert])):
            crc = zlib.crc32(memoryview(dest[t.name]).cast("B"), crc)
        if crc != self.checksums[layer][expert]:
            raise StoreError(
                f"{self.files[-1]}: layer {layer} expert {expert} does not match its checksum: "
                f"the repacked copy is corrupt (run `mlx-moestream repack` again, or delete "
                f"{self.files[-1].parent})"
            )
        self.verified[layer][expert] = True

    def _read_parts(self, layer: int, expert: int, dest: dict[str, np.ndarray]) -> int:
        """One preadv per run of the expert's contiguous tensors (and `_read_rows`). The runs
        lie far apart (a stacked tensor each): on Linux each is requested (POSIX_FADV_WILLNEED,
        up to the device's readahead size of it) before the first is read, so that their
        device round trips overlap (9 cold reads of a 120 KB expert here: 0.3 ms, not 0.9)."""
        parts = sorted((int(t.files[expert]), int(t.offsets[expert]), i)
                       for i, t in enumerate(self.layers[layer]) if not t.rows)
        runs: list[list] = []  # [file, offset, buffers, names, nbytes]
        for file, offset, i in parts:
            t = self.layers[layer][i]
            buf = memoryview(dest[t.name]).cast("B")
            if runs and runs[-1][0] == file and runs[-1][1] + runs[-1][4] == offset:
                runs[-1][2].append(buf)
                runs[-1][3].append(t.name)
                runs[-1][4] += t.nbytes
            else:
                runs.append([file, offset, [buf], [t.name], t.nbytes])
        ranges = [(file, offset, nbytes) for file, offset, _, _, nbytes in runs]
        ranges += [(int(t[0].files[expert]), int(t[0].offsets[expert]), t[0].nbytes * t[0].parts)
                   for t in self.alternating[layer]]
        windows = [(file, w) for file, offset, nbytes in ranges
                   for w in range(offset // DROP_ALIGN, -(-(offset + nbytes) // DROP_ALIGN))
                   ] if self._drops else []
        total, failed, counted = 0, True, False
        try:
            with self._reads_lock:
                for window in windows:
                    self._in_flight[window] = self._in_flight.get(window, 0) + 1
                counted = True
            if len(ranges) > 1 and hasattr(os, "POSIX_FADV_WILLNEED"):
                for file, offset, nbytes in ranges:
                    os.posix_fadvise(self._fds[file], offset, nbytes, os.POSIX_FADV_WILLNEED)
            for file, offset, bufs, names, nbytes in runs:
                where = f"'{'+'.join(names)}' of layer {layer} expert {expert}"
                self._read_run(file, offset, bufs, nbytes, where)
                total += nbytes
            total += self._read_rows(layer, expert, dest)
            failed = False
            return total
        finally:
            if counted:
                self._read_done(windows, failed)

    def _read_done(self, windows: list[tuple[int, int]], failed: bool) -> None:
        """A `_read_parts` ended: drop every window read that no read in progress reads (one
        dropped under a concurrent read would take what it requested and has not read). A
        failed read's windows are dropped again at every drop for `FAILED_DROP_SECONDS`: what
        it requested and did not read may still be arriving, and the kernel does not drop
        pages in flight."""
        now = time.monotonic()
        until = now + FAILED_DROP_SECONDS if failed else 0.0
        with self._reads_lock:  # a read starting meanwhile waits for the drop
            in_flight, undropped = self._in_flight, self._undropped
            for window in windows:
                left = in_flight[window] - 1
                if left:
                    in_flight[window] = left
                else:
                    del in_flight[window]
                undropped[window] = max(undropped.get(window, 0.0), until)
            ready = [window for window in undropped if window not in in_flight]
            self._drop(ready)
            for window in ready:
                if undropped[window] <= now:
                    del undropped[window]

    def _read_rows(self, layer: int, expert: int, dest: dict[str, np.ndarray]) -> int:
        """The expert's tensors whose rows alternate (`ExpertTensor.rows`): their block in one
        read into a buffer, each one's rows copied out of it."""
        total = 0
        for tensors in self.alternating[layer]:
            first = tensors[0]
            nbytes = first.nbytes * first.parts
            buf = self._scratch(nbytes)
            where = f"'{'+'.join(t.name for t in tensors)}' of layer {layer} expert {expert}"
            self._read_run(int(first.files[expert]), int(first.offsets[expert]),
                           [memoryview(buf)[:nbytes]], nbytes, where)
            block = np.frombuffer(buf, np.uint8, nbytes)
            for t in tensors:
                rows = block.reshape(t.rows, t.parts, -1)[:, t.part]
                dest[t.name].reshape(-1).view(np.uint8).reshape(rows.shape)[...] = rows
                total += t.nbytes
        return total

    def _scratch(self, nbytes: int) -> mmap.mmap:
        """This thread's page-aligned buffer of at least `nbytes`, outside the budget."""
        buf = getattr(self._bounce, "buf", None)
        if buf is None or len(buf) < nbytes:
            buf = self._bounce.buf = mmap.mmap(-1, nbytes)  # anonymous memory: page-aligned
        return buf

    def _read_block(self, layer: int, expert: int, dest: dict[str, np.ndarray]) -> int:
        """A repacked expert's page-aligned block in one O_DIRECT read: the page cache is
        bypassed (nothing to drop, no second copy of the expert, and a cold read is faster).
        Direct I/O needs page-aligned buffers: the read lands straight in `dest` when its
        buffers are (the runtime's slot pools are), else in this thread's block-sized buffer
        (outside the budget), copied out."""
        offset, stride = self.blocks[layer]
        start = offset + expert * stride
        tensors = sorted(self.layers[layer], key=lambda t: int(t.offsets[expert]))
        total = sum(t.nbytes for t in tensors)
        buf = self._scratch(stride)
        where = f"layer {layer} expert {expert}"
        file = len(self.files) - 1
        views = [dest[t.name] for t in tensors]
        if all(_page_aligned(v) and t.nbytes % mmap.PAGESIZE == 0 for v, t in zip(views, tensors)):
            bufs = [memoryview(v).cast("B") for v in views]
            if stride > total:
                bufs.append(memoryview(buf)[: stride - total])  # the block's padding
            self._read_run(file, start, bufs, stride, where, fd=self._direct)
            return total
        self._read_run(file, start, [memoryview(buf)[:stride]], stride, where, fd=self._direct)
        block = np.frombuffer(buf, np.uint8, stride)
        for t, view in zip(tensors, views):
            at = int(t.offsets[expert]) - start
            view.reshape(-1).view(np.uint8)[:] = block[at:at + t.nbytes]
        return total

    def _read_run(self, file: int, offset: int, bufs: list[memoryview], nbytes: int,
                  where: str | Callable[[int], str], fd: int | None = None):
        """Read `nbytes` at `offset` into `bufs` (from `fd`, else the file's descriptor);
        `where` names what is read (or, called with the byte a read failed at, returns the
        name) for errors."""
        fd = self._fds[file] if fd is None else fd
        got = 0
        while got < nbytes:
            try:
                n = os.preadv(fd, bufs, offset + got)
            except OSError as e:
                n, why = 0, e.strerror
            else:
                why = "unexpected end of file"
            if n == 0:
                what = where if isinstance(where, str) else where(offset + got)
                raise StoreError(f"{self.files[file]}: cannot read {what} at byte {offset + got}: {why}")
            got += n
            while bufs and n >= len(bufs[0]):  # drop what is filled, keep the rest of a partial
                n -= len(bufs[0])
                bufs = bufs[1:]
            if n:
                bufs = [bufs[0][n:], *bufs[1:]]
        stat = os.fstat(fd)  # after the read: an in-place rewrite before or during it shows
        if _identity(stat) != self.identity[file]:
            what = where if isinstance(where, str) else where(offset)
            raise StoreError(
                f"{self.files[file]}: changed on disk since the model was loaded (size, "
                f"modification or status change time), so {what} cannot be trusted: load the "
                f"model again"
            )

    def _drop(self, windows: list[tuple[int, int]]) -> None:
        """Drop (file, window) windows from the page cache, when the store does (Linux): one
        call per run of adjacent ones."""
        if not self._drops or self._fds is None:
            return
        runs: list[list[int]] = []  # [file, first window, end]
        for file, window in sorted(windows):
            if runs and runs[-1][0] == file and runs[-1][2] == window:
                runs[-1][2] += 1
            else:
                runs.append([file, window, window + 1])
        for file, first, end in runs:
            os.posix_fadvise(self._fds[file], first * DROP_ALIGN, (end - first) * DROP_ALIGN,
                             os.POSIX_FADV_DONTNEED)
