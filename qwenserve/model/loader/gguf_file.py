"""A GGUF file: its metadata and its tensor table, read straight from a memory map.

The gguf package's own GGUFReader builds a numpy view for every element of every metadata array, which
takes about 7 s on the bundled model's 300k-entry vocabulary; this reader parses the same layout with
`struct` in a fraction of a second. Constants (value types, quantization types, block sizes) come from
the gguf package, so the format knowledge lives in one place.
"""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

_SCALAR_FORMATS = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H", GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i", GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q", GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}
_DEFAULT_ALIGNMENT = 32


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]  # torch order: slowest-moving dimension first
    ggml_type: GGMLQuantizationType
    offset: int  # absolute byte offset in the file
    nbytes: int


class GGUFFile:
    """Metadata (`.metadata`, a dict; `.metadata_types`, key -> (value type, item type of an array or None))
    and tensors (`.tensors`, name -> GGUFTensorInfo) of one GGUF file."""

    def __init__(self, path: str):
        self.path = path
        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)  # writable view for torch; never written
        buf = self._map
        if buf[:4] != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file (it does not start with the GGUF magic bytes)")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
        if version not in (2, 3):
            raise ValueError(f"{path}: GGUF version {version} is not supported (2 and 3 are)")
        pos = 24
        self.metadata: dict[str, object] = {}
        self.metadata_types: dict[str, tuple[GGUFValueType, GGUFValueType | None]] = {}
        for _ in range(n_kv):
            key, pos = self._string(pos)
            (vtype,), pos = struct.unpack_from("<I", buf, pos), pos + 4
            vtype = GGUFValueType(vtype)
            item_type = GGUFValueType(struct.unpack_from("<I", buf, pos)[0]) if vtype == GGUFValueType.ARRAY else None
            self.metadata_types[key] = (vtype, item_type)
            self.metadata[key], pos = self._value(vtype, pos)

        table = []
        for _ in range(n_tensors):
            name, pos = self._string(pos)
            (ndim,) = struct.unpack_from("<I", buf, pos)
            dims = struct.unpack_from(f"<{ndim}Q", buf, pos + 4)
            ggml_type, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * ndim)
            pos += 4 + 8 * ndim + 12
            table.append((name, tuple(reversed(dims)), GGMLQuantizationType(ggml_type), offset))

        alignment = int(self.metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
        data_start = (pos + alignment - 1) // alignment * alignment
        self.tensors: dict[str, GGUFTensorInfo] = {}
        for name, shape, ggml_type, offset in table:
            block_elems, block_bytes = GGML_QUANT_SIZES[ggml_type]
            n_elems = int(np.prod(shape))
            if n_elems % block_elems:
                raise ValueError(f"{path}: tensor {name} has {n_elems} elements, not a multiple of its "
                                 f"{ggml_type.name} block of {block_elems}")
            nbytes = n_elems // block_elems * block_bytes
            start = data_start + offset
            if start + nbytes > len(buf):
                raise ValueError(f"{path}: tensor {name} runs past the end of the file (truncated download?)")
            self.tensors[name] = GGUFTensorInfo(name, shape, ggml_type, start, nbytes)

    def release_pages(self) -> None:
        """Drop the file's pages from this process's memory. The model copies most tensors at load (into its own
        layouts), yet the pages read stay resident while anything maps the file: released only at the end, they
        made the peak of loading the file's size above the weights (1.9 GB for a 3B Q4_K_M file). What still
        reads the file (blocks kept in its layout) faults its pages back in. The map is private and never
        written, so nothing is lost."""
        if hasattr(mmap, "MADV_DONTNEED"):
            self._map.madvise(mmap.MADV_DONTNEED)

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as a uint8 array over the memory map (no copy)."""
        info = self.tensors[name]
        return np.frombuffer(self._map, dtype=np.uint8, count=info.nbytes, offset=info.offset)

    def _string(self, pos: int) -> tuple[str, int]:
        (length,) = struct.unpack_from("<Q", self._map, pos)
        pos += 8
        return self._map[pos:pos + length].decode("utf-8", errors="replace"), pos + length

    def _value(self, vtype: GGUFValueType, pos: int):
        if vtype == GGUFValueType.STRING:
            return self._string(pos)
        if vtype == GGUFValueType.ARRAY:
            item_type, count = struct.unpack_from("<IQ", self._map, pos)
            pos += 12
            item_type = GGUFValueType(item_type)
            if item_type in _SCALAR_FORMATS:  # numeric arrays in one unpack
                fmt = _SCALAR_FORMATS[item_type]
                size = struct.calcsize(fmt)
                values = list(struct.unpack_from("<" + fmt[1] * count, self._map, pos))
                return values, pos + size * count
            items = []
            for _ in range(count):
                item, pos = self._value(item_type, pos)
                items.append(item)
            return items, pos
        fmt = _SCALAR_FORMATS[vtype]
        return struct.unpack_from(fmt, self._map, pos)[0], pos + struct.calcsize(fmt)
