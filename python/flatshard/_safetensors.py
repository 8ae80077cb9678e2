"""Reads the float32 tensors of a safetensors file that flatshard wrote (an export's
optimizer.safetensors, or its split files through their index), for
ShardedModule.optim_state_dict, and writes one (load_optim_state_dict). The format: an
8-byte little-endian header length N, N bytes of JSON {name: {"dtype", "shape",
"data_offsets": [begin, end)}, "__metadata__": {str: str}}, then the data, offsets
relative to its start."""

import json
import os
import struct

import numpy as np

from ._errors import DataLossError


def _read_file(path):
    arrays = {}
    with open(path, "rb") as f:
        (header_bytes,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_bytes))
        metadata = header.pop("__metadata__", {})
        data_start = 8 + header_bytes
        for name, entry in header.items():
            begin, end = entry["data_offsets"]
            if entry["dtype"] != "F32" or end - begin != 4 * int(np.prod(entry["shape"], dtype=np.int64)):
                raise DataLossError(f"'{path}': tensor '{name}' is not float32 of shape {entry['shape']}")
            f.seek(data_start + begin)
            arrays[name] = np.fromfile(f, dtype="<f4", count=(end - begin) // 4).reshape(entry["shape"])
    return arrays, metadata


def read_floats(directory, prefix):
    """({name: float32 array}, metadata) of `prefix`.safetensors in `directory`, or of the
    files its `prefix`.safetensors.index.json names."""
    index = os.path.join(directory, f"{prefix}.safetensors.index.json")
    if not os.path.exists(index):
        return _read_file(os.path.join(directory, f"{prefix}.safetensors"))
    with open(index) as f:
        files = sorted(set(json.load(f)["weight_map"].values()))
    arrays, metadata = {}, {}
    for name in files:
        part, part_metadata = _read_file(os.path.join(directory, name))
        arrays.update(part)
        metadata.update(part_metadata)
    return arrays, metadata


def write_floats(path, arrays, metadata):
    """Writes {name: float32 array} and metadata ({str: str}) as one safetensors file, the
    header padded with spaces to a multiple of 8 as the format asks, the tensors in the
    given order."""
    header, offset = {}, 0
    for name, array in arrays.items():
        header[name] = {"dtype": "F32", "shape": list(array.shape), "data_offsets": [offset, offset + 4 * array.size]}
        offset += 4 * array.size
    header["__metadata__"] = metadata
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for array in arrays.values():
            f.write(np.ascontiguousarray(array, dtype="<f4").tobytes())


def remove_files(directory, prefix):
    """Removes `prefix`.safetensors, its split files and their index from `directory`."""
    for name in os.listdir(directory):
        if name.startswith(prefix) and (name.endswith(".safetensors") or name.endswith(".safetensors.index.json")):
            os.remove(os.path.join(directory, name))
