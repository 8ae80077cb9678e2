"""flatshard.LocalCluster as the Python tests start it: every server also checks the
order in which its threads take locks (--mutex_deadlock_detection, off by default for
its cost), as the C++ integration suite's servers do, so a lock-order cycle any test
reaches fails that server loudly instead of hanging it one day."""

import flatshard


def LocalCluster(*, server_args=(), **kwargs):
    """flatshard.LocalCluster(**kwargs) with --mutex_deadlock_detection before
    ``server_args``."""
    return flatshard.LocalCluster(server_args=["--mutex_deadlock_detection", *server_args], **kwargs)
