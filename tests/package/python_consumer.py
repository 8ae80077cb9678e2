"""Run by package_test.cmake against an installed prefix, with only the prefix's Python
directory on PYTHONPATH: the flatshard package comes from the prefix, its LocalCluster
starts the server installed there, and one SGD step lands as float64 arithmetic says.

    python3 python_consumer.py PREFIX
"""

import os
import sys

import numpy as np

import flatshard
from flatshard import _paths

prefix = os.path.realpath(sys.argv[1])
assert os.path.realpath(flatshard.__file__).startswith(prefix + os.sep), flatshard.__file__
assert os.path.realpath(_paths.SERVER_BINARY) == os.path.join(prefix, "bin", "flatshard-server"), _paths.SERVER_BINARY
with flatshard.LocalCluster(servers=1) as cluster:
    client = flatshard.Client(cluster.addresses, token=cluster.token)
    client.configure_job()
    client.register_group("g", [("w", (4,), "float32")], flatshard.SGD(lr=0.5))
    client.init_group("g", {"w": np.arange(4, dtype=np.float32)})
    client.scatter("g", {"w": np.full(4, 3.0, np.float32)}, step=0)
    flat, version = client.gather_flat("g", min_version=1)
    expected = np.arange(4, dtype=np.float64) - 0.5 * 3.0
    assert version == 1 and np.array_equal(flat[:4].astype(np.float64), expected), (version, flat)
print(f"the installed package trained one step on {_paths.SERVER_BINARY}")
