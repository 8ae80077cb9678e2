"""FULL checkpoints against the `safetensors` library (Hugging Face's reader), which
Debian does not package: a checkpoint is made where flatshard runs, and checked where
the library is installed (the device machine's PyTorch environment has it).

  /usr/bin/python3 safetensors_library_check.py make DIR    # needs the flatshard package
  python3 safetensors_library_check.py check DIR            # needs safetensors and torch

`make` trains 3 servers for a few AdamW steps on tensors of every gather dtype with
sizes that do not divide evenly, saves FULL checkpoints with optimizer state (one file,
and split into several files by --max_file_size with an index), exports one to DIR, and
writes what the servers hold (`expected.npz`, gathered in each tensor's dtype). `check`
loads every file with `safetensors.torch.load_file` and `safe_open`, and requires the
tensors to be bitwise what the servers held, the metadata to be what the spec reader
(safetensors_reader.py) reads, and each index to map every tensor to the file holding
it. Exits non-zero on the first mismatch.
"""

import json
import os
import shutil
import sys
import tempfile

import numpy as np

TENSORS = [("embed.weight", (33, 7), "float32"), ("block.norm", (7,), "bfloat16"),
           ("block.proj", (5, 7), "float16"), ("head.bias", (3,), "float32"),
           ("scale", (), "float32")]
STEPS = 3


def make(out_dir):
    import checked_cluster
    import flatshard

    os.makedirs(out_dir, exist_ok=True)
    with tempfile.TemporaryDirectory() as root:
        # 400 bytes per file: the FULL save splits into several files with an index.
        with checked_cluster.LocalCluster(servers=3, checkpoint_root=root,
                                          server_args=["--max_file_size=400"]) as cluster:
            client = flatshard.Client(cluster.addresses, token=cluster.token, job="st")
            client.configure_job()
            client.register_group("g", TENSORS, flatshard.AdamW(lr=1e-2, weight_decay=0.1))
            rng = np.random.default_rng(7)
            client.init_group("g", {name: rng.standard_normal(shape).astype(np.float32)
                                    for name, shape, _ in TENSORS})
            for step in range(STEPS):
                client.scatter("g", {name: rng.standard_normal(shape).astype(np.float32)
                                     for name, shape, _ in TENSORS}, step)
            client.gather("g", min_version=STEPS)
            expected = {}
            for dtype in ("float32", "bfloat16", "float16"):
                gathered = client.gather("g", dtype=dtype)
                for name, _, tensor_dtype in TENSORS:
                    if tensor_dtype == dtype:
                        expected[name] = gathered[name]  # bfloat16 comes as int16 bits
            np.savez(os.path.join(out_dir, "expected.npz"),
                     **{name: _raw(array) for name, array in expected.items()})
            client.save_checkpoint("multi", kind="full", optimizer=True)
            shutil.copytree(os.path.join(root, "multi"), os.path.join(out_dir, "multi"))
            client.export_state_dict(os.path.join(out_dir, "exported"), kind="full", optimizer=True)
    print(f"made {out_dir}: {sorted(os.listdir(out_dir))}")


def _raw(array):
    """The array's bytes as unsigned integers of its width (bf16 has no numpy dtype)."""
    array = np.ascontiguousarray(array)
    return array.view({2: np.uint16, 4: np.uint32}[array.dtype.itemsize])


def _bits(tensor):
    """A tensor's bits as a numpy array of unsigned integers of its width."""
    import torch
    width = {2: torch.int16, 4: torch.int32}[tensor.element_size()]
    return _raw(tensor.contiguous().view(width).numpy())


def _same_bits(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(_bits(a), _bits(b))


def check(out_dir):
    import torch
    import safetensors
    from safetensors import safe_open
    from safetensors.torch import load_file
    from safetensors_reader import read_safetensors

    expected = dict(np.load(os.path.join(out_dir, "expected.npz")))
    checked = 0
    for sub in ("multi", "exported"):
        directory = os.path.join(out_dir, sub)
        found = set()
        for prefix in ("model", "optimizer"):
            files = sorted(f for f in os.listdir(directory)
                           if f.endswith(".safetensors") and f.split("-")[0].split(".")[0] == prefix)
            if not files:
                sys.exit(f"{directory}: no {prefix} safetensors files")
            where = {}
            total_bytes = 0
            for name in files:
                path = os.path.join(directory, name)
                by_library = load_file(path)
                by_spec, metadata = read_safetensors(path)
                with safe_open(path, framework="pt") as f:
                    if (f.metadata() or {}) != metadata:
                        sys.exit(f"{path}: metadata {f.metadata()} vs the spec reader's {metadata}")
                if set(by_library) != set(by_spec):
                    sys.exit(f"{path}: tensors {sorted(by_library)} vs {sorted(by_spec)}")
                for tensor_name, tensor in by_library.items():
                    if not _same_bits(tensor, by_spec[tensor_name]):
                        sys.exit(f"{path}: {tensor_name} differs between the library and the spec reader")
                    if tensor_name in expected and not np.array_equal(_bits(tensor), expected[tensor_name]):
                        sys.exit(f"{path}: {tensor_name} is not what the servers held")
                    where[tensor_name] = name
                    total_bytes += tensor.numel() * tensor.element_size()
                    checked += 1
            if len(files) > 1:
                index_path = os.path.join(directory, f"{prefix}.safetensors.index.json")
                with open(index_path) as f:
                    index = json.load(f)
                if index["weight_map"] != where:
                    sys.exit(f"{index_path}: weight_map {index['weight_map']} vs the files' tensors {where}")
                if int(index["metadata"]["total_size"]) != total_bytes:
                    sys.exit(f"{index_path}: total_size {index['metadata']['total_size']} vs {total_bytes}")
            print(f"{directory}: {len(files)} {prefix} file(s), {len(where)} tensors")
            found |= set(where)
        wanted = set(expected) | {f"{name}.{state}" for name, _, _ in TENSORS
                                  for state in ("exp_avg", "exp_avg_sq")}
        if wanted - found:
            sys.exit(f"{directory}: missing {sorted(wanted - found)}")
    print(f"ok: {checked} tensors read by safetensors {safetensors.__version__} equal the spec "
          f"reader's and the servers' bits")


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("make", "check"):
        sys.exit(__doc__)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    (make if sys.argv[1] == "make" else check)(sys.argv[2])
