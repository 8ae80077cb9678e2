"""flatshard.LocalCluster: flatshard-server processes on 127.0.0.1, for notebooks and tests."""

import os
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time

from ._errors import UnavailableError


def _server_binary(explicit):
    if explicit:
        return explicit
    if os.environ.get("FLATSHARD_SERVER_BINARY"):
        return os.environ["FLATSHARD_SERVER_BINARY"]
    try:
        from ._paths import SERVER_BINARY
        if os.path.exists(SERVER_BINARY):
            return SERVER_BINARY
    except ImportError:
        pass
    found = shutil.which("flatshard-server")
    if found:
        return found
    raise UnavailableError("flatshard-server not found: set FLATSHARD_SERVER_BINARY or put it on PATH")


def _free_ports(count):
    """`count` distinct free ports on 127.0.0.1, all bound at once so none repeats."""
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


class _PortTaken(Exception):
    """A server exited because its port was taken before it could bind it."""


class LocalCluster:
    """Starts ``servers`` flatshard-server processes on free loopback ports.

    Use as a context manager; ``addresses`` is the list to pass as ``servers=`` to
    flatshard.Client and ``token`` the token (generated when not given). Servers given
    the same ``checkpoint_root`` (two clusters one after the other, say) see the same
    checkpoints. ``memory`` is the servers' --memory tier; ``server_args`` are more
    flags for every server (``["--max_file_size=1000000"]``), except those that would
    hide a server's start-up line (logged at info to stderr, which ``server_log(rank)``
    reads): ``--log_file`` and ``--log_level=warning|error`` are refused with ValueError.
    The processes are stopped (SIGTERM, then SIGKILL) on exit or by ``close()``.
    """

    def __init__(self, servers=2, checkpoint_root=None, token=None, memory="host",
                 server_binary=None, startup_timeout=30.0, server_args=()):
        if servers < 1:
            raise ValueError("servers must be >= 1")
        self._binary = _server_binary(server_binary)
        self.num_servers = servers
        self.checkpoint_root = checkpoint_root
        self.token = token if token is not None else secrets.token_hex(16)
        self.memory = memory
        self.server_args = list(server_args)
        for arg in self.server_args:
            name, _, value = arg.partition("=")
            if name == "--log_file" or (name == "--log_level" and value in ("warning", "error")):
                raise ValueError(f"server_args: {arg} would hide the servers' start-up line, which "
                                 "LocalCluster waits for in their logs (server_log(rank))")
        self._startup_timeout = startup_timeout
        self._processes = []
        self._scratch = None
        self.addresses = []

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def start(self):
        # A port picked free can be taken by another process before its server binds
        # it; that server then exits, and the cluster starts again on other ports.
        for attempt in range(3):
            try:
                return self._start_once()
            except _PortTaken:
                if attempt == 2:
                    raise UnavailableError("flatshard-server: the free ports picked were taken "
                                           "before the servers bound them, three times") from None

    def _start_once(self):
        self._scratch = tempfile.mkdtemp(prefix="flatshard-local-")
        token_file = os.path.join(self._scratch, "token")
        with open(token_file, "w") as f:
            f.write(self.token + "\n")
        ports = _free_ports(2 * self.num_servers)
        self.addresses = [f"127.0.0.1:{ports[2 * i]}" for i in range(self.num_servers)]
        for rank in range(self.num_servers):
            args = [self._binary, f"--listen={self.addresses[rank]}",
                    f"--data_listen=127.0.0.1:{ports[2 * rank + 1]}", f"--rank={rank}",
                    "--cluster=" + ",".join(self.addresses), f"--auth_token_file={token_file}",
                    f"--memory={self.memory}"]
            if self.checkpoint_root:
                args.append(f"--checkpoint_root={self.checkpoint_root}")
            args += self.server_args
            with open(os.path.join(self._scratch, f"server-{rank}.log"), "w") as log:
                self._processes.append(subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT))
        # A server says it serves once both of its ports are bound: a port another
        # process holds would take connections too, so connecting proves nothing.
        deadline = time.monotonic() + self._startup_timeout
        for rank in range(self.num_servers):
            serving = f"serving as rank {rank} of {self.num_servers}: control "
            while serving not in self.server_log(rank):
                if self._processes[rank].poll() is not None:
                    log = self.server_log(rank)
                    self.close()
                    if "Address already in use" in log or "cannot listen" in log:
                        raise _PortTaken()
                    raise UnavailableError(f"flatshard-server rank {rank} exited: {log.strip()}")
                if time.monotonic() > deadline:
                    self.close()
                    raise UnavailableError(f"flatshard-server rank {rank} did not start")
                time.sleep(0.02)
        return self

    def server_log(self, rank):
        """What server `rank` printed so far."""
        try:
            with open(os.path.join(self._scratch, f"server-{rank}.log")) as f:
                return f.read()
        except OSError:
            return ""

    def kill(self, rank):
        """SIGKILLs server `rank` (fault tests)."""
        self._processes[rank].kill()
        self._processes[rank].wait()

    def pause(self, rank):
        """SIGSTOPs server `rank`, which then stops answering as a hung host does (fault
        tests); returns once all of its threads have stopped. resume(rank) undoes it."""
        pid = self._processes[rank].pid
        os.kill(pid, signal.SIGSTOP)
        os.waitpid(pid, os.WUNTRACED)

    def resume(self, rank):
        """Lets a paused server go on (SIGCONT)."""
        os.kill(self._processes[rank].pid, signal.SIGCONT)

    def close(self):
        for process in self._processes:
            if process.poll() is None:
                process.terminate()
                os.kill(process.pid, signal.SIGCONT)  # a paused server takes the SIGTERM
        for process in self._processes:
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self._processes = []
        if self._scratch:
            shutil.rmtree(self._scratch, ignore_errors=True)
            self._scratch = None
