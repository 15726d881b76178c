"""Where each expert's bytes live in a model's files, and reading them into given buffers.

`ExpertStore` joins the checkpoint's index (`checkpoint.py`), a repacked copy when its manifest
holds (`manifest.py`) and the raw reader (`rawio.py`). Plain Python and numpy (no mlx), so any
backend can stream from the same store.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import warnings
import zlib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import numpy as np

from .checkpoint import Checkpoint, ExpertTensor, TensorInfo, file_identity, stat_file
from .errors import StoreError
from .manifest import find_repacked, packed_tensors, read_manifest
from .rawio import FileReader, page_aligned

# Reading every expert at load (`plan_reads`), one read covers at most this many bytes: macOS
# fails reads past 2 GiB, and several reads let several threads share a file.
READ_RUN_BYTES = 8 * 2**20
# A gap of other tensors between two expert tensors up to this size is read into scratch, not
# skipped: a separate read costs a device round trip, worth a few hundred KB at disk speed.
READ_GAP_BYTES = 256 * 2**10
# buffers one preadv takes (Linux and macOS: 1024)
IOV_MAX = os.sysconf("SC_IOV_MAX") if "SC_IOV_MAX" in getattr(os, "sysconf_names", {}) else 1024


@dataclass
class Run:
    """One read of a full-budget load: a span of one file holding expert tensors or their pieces.

    The pieces land in their buffers, and the small gaps between them in scratch.
    """

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


class ExpertStore:
    """Index of every shard of a model directory; reads one expert's tensors into given buffers.

    Args:
        drop_page_cache: Keep no page read in the OS cache, so that it holds no second copy of
            the experts on top of the budget.
        repacked: A copy made by `repack` (default: `find_repacked(model_dir)` when present;
            False: none); used when its manifest is valid, else ignored with a warning.
    """

    def __init__(self, model_dir: str | Path, drop_page_cache: bool = True,
                 repacked: str | Path | bool | None = None):
        self.model_dir = Path(model_dir)
        self.drop_page_cache = drop_page_cache
        self.checkpoint = Checkpoint(self.model_dir)
        self.tensors: dict[str, TensorInfo] = self.checkpoint.tensors
        self.files = list(self.checkpoint.files)
        # what each file was when indexed: every read checks the file still is
        self.identity = list(self.checkpoint.identity)
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
                manifest = read_manifest(folder, self.checkpoint.files)
            except StoreError as e:
                warnings.warn(f"ignoring the repacked experts: {e}", stacklevel=2)
            else:
                binary = folder / "experts.bin"
                self.files.append(binary)
                self.identity.append(file_identity(binary.stat()))  # its blocks have crc32s too
                self.repacked = {layer["name"]: layer for layer in manifest["layers"]}
        self.reader = FileReader(self.files, self.identity, drop_page_cache, bool(self.repacked))

    def add_layer(self, prefix: str, params: dict[str, tuple[tuple[int, ...], int]], num_experts: int,
                  share: range | None = None) -> int:
        """Locate a MoE layer's expert tensors, in the repacked copy or the checkpoint.

        Args:
            prefix: The expert module's parameter path (e.g. `model.layers.3.mlp.switch_mlp`).
            params: Its per-expert parameter names (`gate_proj.weight`, ...) to the shape and
                byte size of one expert's slice.
            share: Serve only these of the experts (a host's): the layer's expert i is then
                `share[i]`.

        Returns:
            The layer's index in this store.
        """
        packed = self.repacked.get(prefix)
        sizes = {name: nbytes for name, (_, nbytes) in params.items()}
        if packed and {t["name"]: t["nbytes"] for t in packed["tensors"]} == sizes:
            located = packed_tensors(packed, len(self.files) - 1, num_experts)
            self.blocks.append((packed["offset"], packed["stride"]))
            self.checksums.append(np.array(packed["crc32"], np.uint32))
            self.verified.append(np.zeros(num_experts, np.bool_))
        else:
            located = [self.checkpoint.locate(prefix, name, shape, nbytes, num_experts)
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

    def stacked_key(self, parent: str, name: str) -> str | None:
        """The checkpoint's whole stacked tensor a fused experts module reads (see `Checkpoint`)."""
        return self.checkpoint.stacked_key(parent, name)

    def open(self) -> None:
        """Open the files, once (see `FileReader.open`)."""
        self.reader.open()

    def close(self) -> None:
        """Drop what reads left cached and close the files; a later read opens them again."""
        self.reader.close()

    def forked(self) -> None:
        """Forget, in a forked child, the reads in progress at the fork (`Runtime.forked`)."""
        self.reader.forked()

    @property
    def _direct(self) -> int | None:
        """The repacked copy's direct I/O descriptor, once open and if it has one."""
        return self.reader.direct

    def read_expert(self, layer: int, expert: int, dest: dict[str, np.ndarray]) -> int:
        """Read one expert's tensors straight into `dest` buffers; returns the bytes read.

        One preadv per run of contiguous tensors: one per expert in a repacked store (direct I/O
        on Linux, see `_read_block`).
        """
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
        """Whether `layer` is read expert by expert: repacked, or its rows interleaved."""
        return self.blocks[layer] is not None or bool(self.alternating[layer])

    def plan_reads(self, dests: dict[int, dict[str, np.ndarray]]) -> list[Run]:
        """Reads of every expert of the layers in `dests`, in file order, as few as limits allow.

        Checkpoints place tensors in any order, so a layer's lie among other layers' and dense
        ones: reads take the gaps (`READ_GAP_BYTES`) up to `READ_RUN_BYTES` and `IOV_MAX`.

        Args:
            dests: Store layer -> its [experts, ...] buffers, one per tensor; not `expert_major`.
        """
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
        # The gaps' pages stay cached: they hold dense weights, which the model reads next.
        self.reader.drop_spans(run.file, [(offset, len(buf)) for offset, _, _, buf in run.pieces])

    def fingerprint(self, samples: int = 16, sample_bytes: int = 4096,
                    small_bytes: int = 4 << 20) -> bytes:
        """A digest of the checkpoint's files, for hosts to check they hold the same one.

        Names, sizes and `samples` blocks of each file tell another fine-tune, quantization or
        seed; every tensor of at most `small_bytes`, read whole, tells a fixed router or norm.
        """
        self.open()
        digest = hashlib.sha256()
        small: dict[int, list[tuple[int, int]]] = {}
        for t in self.tensors.values():
            if t.nbytes <= small_bytes:
                small.setdefault(t.file, []).append((t.offset, t.nbytes))
        for file, (path, fd) in enumerate(zip(self.checkpoint.files, self.reader.fds)):
            size = os.fstat(fd).st_size
            digest.update(f"{path.name}:{size}".encode())
            for i in range(samples):
                digest.update(os.pread(fd, sample_bytes, i * max(size - sample_bytes, 0)
                                       // max(samples - 1, 1)))
            for offset, nbytes in sorted(small.get(file, ())):
                digest.update(os.pread(fd, nbytes, offset))
        return digest.digest()

    def loaded(self) -> None:
        """Check the files unchanged once a load has read them, then drop their cached pages.

        A shard rewritten meanwhile (a download finishing) gave the dense weights other bytes
        than the experts; reads in runs leave gaps cached for the dense weights.
        """
        for path, identity in zip(self.files, self.identity):
            if file_identity(stat_file(path)) != identity:
                raise StoreError(f"{path}: changed on disk while the model loaded (size, "
                                 f"modification or status change time): load it again")
        self.reader.drop_all()

    def _verify(self, layer: int, expert: int, dest: dict[str, np.ndarray]) -> None:
        """Check a repacked expert's first read in a session against the crc32 taken at repack.

        About 0.2 ms per MiB here: a corrupt block is an error, never an input.
        """
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
        """Read an expert with one preadv per run of its contiguous tensors (and `_read_rows`)."""
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
        total = 0
        with self.reader.reading(ranges):
            for file, offset, bufs, names, nbytes in runs:
                where = f"'{'+'.join(names)}' of layer {layer} expert {expert}"
                self._read_run(file, offset, bufs, nbytes, where)
                total += nbytes
            return total + self._read_rows(layer, expert, dest)

    def _read_rows(self, layer: int, expert: int, dest: dict[str, np.ndarray]) -> int:
        """Read the tensors whose rows alternate (`ExpertTensor.rows`): a block, then copies."""
        total = 0
        for tensors in self.alternating[layer]:
            first = tensors[0]
            nbytes = first.nbytes * first.parts
            buf = self.reader.scratch(nbytes)
            where = f"'{'+'.join(t.name for t in tensors)}' of layer {layer} expert {expert}"
            self._read_run(int(first.files[expert]), int(first.offsets[expert]),
                           [memoryview(buf)[:nbytes]], nbytes, where)
            block = np.frombuffer(buf, np.uint8, nbytes)
            for t in tensors:
                rows = block.reshape(t.rows, t.parts, -1)[:, t.part]
                dest[t.name].reshape(-1).view(np.uint8).reshape(rows.shape)[...] = rows
                total += t.nbytes
        return total

    def _read_block(self, layer: int, expert: int, dest: dict[str, np.ndarray]) -> int:
        """Read a repacked expert's page-aligned block in one O_DIRECT read.

        Bypassing the page cache leaves nothing to drop and makes a cold read faster. The read
        lands straight in `dest` when its buffers are page-aligned (slot pools' are), else in
        this thread's scratch buffer, copied out.
        """
        offset, stride = self.blocks[layer]
        start = offset + expert * stride
        tensors = sorted(self.layers[layer], key=lambda t: int(t.offsets[expert]))
        total = sum(t.nbytes for t in tensors)
        buf = self.reader.scratch(stride)
        where = f"layer {layer} expert {expert}"
        file = len(self.files) - 1
        views = [dest[t.name] for t in tensors]
        if all(page_aligned(v) and t.nbytes % mmap.PAGESIZE == 0 for v, t in zip(views, tensors)):
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
                  where: str | Callable[[int], str], fd: int | None = None) -> None:
        """The one read every read of the store makes (`FileReader.read`)."""
        self.reader.read(file, offset, bufs, nbytes, where, fd)
