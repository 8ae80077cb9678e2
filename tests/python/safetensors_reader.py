"""A safetensors reader (and writer) written from the format's specification, independent of flatshard
(Debian ships no `safetensors` package): 8-byte little-endian header length N, N bytes of
JSON {name: {dtype, shape, data_offsets: [begin, end)}, "__metadata__": {str: str}},
then the data, offsets relative to its start."""

import json
import struct

import numpy as np
import torch

_DTYPES = {"F32": (np.float32, torch.float32), "F16": (np.float16, torch.float16),
           "BF16": (np.int16, torch.bfloat16), "F64": (np.float64, torch.float64)}


def read_safetensors(path):
    """{name: torch.Tensor} and the metadata dict."""
    with open(path, "rb") as f:
        blob = f.read()
    (header_len,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + header_len])
    metadata = header.pop("__metadata__", {})
    data = blob[8 + header_len:]
    tensors = {}
    for name, entry in header.items():
        begin, end = entry["data_offsets"]
        np_dtype, torch_dtype = _DTYPES[entry["dtype"]]
        array = np.frombuffer(data[begin:end], dtype=np_dtype).copy().reshape(entry["shape"])
        tensor = torch.from_numpy(array)
        tensors[name] = tensor.view(torch_dtype) if torch_dtype == torch.bfloat16 else tensor
    return tensors, metadata


def write_safetensors(path, tensors, metadata=None):
    """Writes {name: torch.Tensor} (dtypes of _DTYPES) as the specification lays a file out:
    the header padded with spaces to a multiple of 8, the tensors in the given order."""
    names = {dtype: name for name, (_, dtype) in _DTYPES.items()}
    header, blobs, offset = {}, [], 0
    for name, tensor in tensors.items():
        data = tensor.contiguous().view(torch.uint8).numpy().tobytes() if tensor.numel() else b""
        header[name] = {"dtype": names[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    if metadata:
        header["__metadata__"] = metadata
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))
