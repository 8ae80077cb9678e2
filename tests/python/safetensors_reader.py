"""A safetensors reader written from the format's specification, independent of flatshard
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
