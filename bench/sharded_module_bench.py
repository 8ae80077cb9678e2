#!/usr/bin/env python3
"""flatshard.torch.ShardedModule's training step against torch's own, side by side.

A chain of small Linear layers (32x32, 1056 parameters each), one group per layer
(auto_wrap_min_params=1), trained with AdamW by one worker on a LocalCluster of 2
servers, against the same model trained in this process with torch.optim.AdamW. Both
run forward, backward and the optimizer step on the same batch, with a learning rate
set before every step (a schedule); the time per step is the median of 5 rounds (after
3 warm-up steps). The ratio is torch's time over
ShardedModule's: what a worker keeps of its local speed when each layer's parameters are
gathered from the servers and its gradients reduced and stepped there. Small layers are
where the cost per group (a gather and a scatter per server, the waits) shows most;
ShardedModule sends small groups' requests in pipelines (bench/RESULTS.md, "Pipelined
transfers of many small groups"). With --tls the servers speak TLS on both planes
(--tls_data_plane, with a throwaway CA the openssl command makes). With --batchnorm each
layer is followed by a BatchNorm1d, whose running statistics ShardedModule keeps on the
servers (one more group, gathered and sent every step with the others). With --reshard
the module frees each layer's parameters after its forward and gathers them again for its
backward (reshard_after_forward=True: a second gather per group and step), and a second
table sets 8 layers of 1024x1024 (4 MiB each, batch 64) by default and resharded beside
torch: the time per step and the parameters a worker holds at its layers' forwards (the
most, over every step: the first, whose forward is watched for uses outside the
modules', included).

    PYTHONPATH=build/python /usr/bin/python3 bench/sharded_module_bench.py [--quick] [--tls] [--batchnorm] [--reshard]
"""
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

import flatshard
import flatshard.torch


BATCHNORM = "--batchnorm" in sys.argv[1:]
RESHARD = "--reshard" in sys.argv[1:]


def model(layers, width=32):
    torch.manual_seed(0)
    if BATCHNORM:  # no bias before BatchNorm (it subtracts the batch mean)
        return torch.nn.Sequential(*[module for _ in range(layers)
                                     for module in (torch.nn.Linear(width, width, bias=False),
                                                    torch.nn.BatchNorm1d(width))])
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])


def learning_rate(step):
    """A warm-up schedule: a new learning rate every step."""
    return 1e-3 * min(1.0, (step + 1) / 1000)


def time_steps(step, steps):
    """Median seconds per step of 5 rounds of `steps` steps, after 3 warm-up steps."""
    count = 0
    for _ in range(3):
        step(count)
        count += 1
    rounds = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(steps):
            step(count)
            count += 1
        rounds.append((time.perf_counter() - start) / steps)
    return statistics.median(rounds)


def torch_step_time(layers, batch, steps):
    net = model(layers, batch.shape[1])
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)

    def step(count):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(count)
        net(batch).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return time_steps(step, steps)


def tls_files(directory):
    """A CA and a certificate for 127.0.0.1 it signed, made in `directory` with the openssl
    command: the servers' flags for TLS on both planes, and the CA file clients trust."""
    key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes"]

    def openssl(*args):
        subprocess.run(["openssl", *args], cwd=directory, check=True, capture_output=True)

    openssl("req", "-x509", *key, "-keyout", "ca.key", "-out", "ca.pem", "-days", "1", "-subj", "/CN=bench-ca")
    openssl("req", *key, "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=127.0.0.1")
    with open(os.path.join(directory, "san.cnf"), "w") as f:
        f.write("subjectAltName=IP:127.0.0.1\n")
    openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
            "-days", "1", "-extfile", "san.cnf", "-out", "server.pem")
    ca = os.path.join(directory, "ca.pem")
    return [f"--tls_cert_file={directory}/server.pem", f"--tls_key_file={directory}/server.key",
            f"--tls_ca_file={ca}", "--tls_data_plane"], ca


def sharded_step_time(cluster, layers, batch, steps, tls_ca_file=None, reshard=RESHARD, measure_held=False):
    """(seconds per step, with `measure_held` the most parameter bytes the worker held at a
    layer's forward in any step: the hooks that look cost time per layer)."""
    client = flatshard.Client(servers=cluster.addresses, token=cluster.token,
                              job=f"bench-{layers}-{batch.shape[1]}-{reshard}", tls_ca_file=tls_ca_file)
    client.configure_job()
    sharded = flatshard.torch.ShardedModule(model(layers, batch.shape[1]), client,
                                            optimizer=flatshard.AdamW(lr=1e-3), auto_wrap_min_params=1,
                                            reshard_after_forward=reshard)
    held = [0]  # the most bytes

    def sample(*_):
        held[0] = max(held[0], sum(p.numel() * p.element_size() for p in sharded.module.parameters()))

    for layer in sharded.module if measure_held else ():
        layer.register_forward_pre_hook(sample)

    def step(count):
        sharded.set_hyperparams(lr=learning_rate(count))
        sharded(batch).pow(2).mean().backward()
        sharded.step()

    seconds = time_steps(step, steps)
    sharded.delete_job()
    return seconds, held[0]


def run(cluster, batch, quick, tls_ca_file):
    """Prints a row per model size: ShardedModule's step on `cluster` against torch's."""
    for layers in ((10, 100) if quick else (10, 100, 1000)):
        steps = max(2, 2000 // layers)
        sharded, _ = sharded_step_time(cluster, layers, batch, steps, tls_ca_file)
        local = torch_step_time(layers, batch, steps)
        groups = 2 * layers if BATCHNORM else layers  # each Linear and BatchNorm1d its own
        print(f"{groups:>7} {sharded * 1e3:>17.2f} {local * 1e3:>9.2f} "
              f"{(sharded - local) / groups * 1e6:>13.0f} {local / sharded:>6.2f}x", flush=True)


def run_wide(cluster):
    """The second table of --reshard: 8 layers of 1024x1024, by default and resharded."""
    batch = torch.randn(64, 1024)
    print(f"\n{'8 x 1024x1024':>13} {'ms':>8} {'torch ms':>9} {'ratio':>7} {'held MiB':>9}")
    local = torch_step_time(8, batch, 3)
    for reshard in (False, True):
        seconds, held = sharded_step_time(cluster, 8, batch, 3, reshard=reshard, measure_held=True)
        print(f"{'resharded' if reshard else 'default':>13} {seconds * 1e3:>8.1f} {local * 1e3:>9.1f} "
              f"{local / seconds:>6.2f}x {held / 2**20:>9.1f}", flush=True)


def main():
    quick = "--quick" in sys.argv[1:]
    torch.set_num_threads(1)  # the servers share this machine's cores
    batch = torch.randn(8, 32)
    with tempfile.TemporaryDirectory() as tls_dir:
        server_args, ca = tls_files(tls_dir) if "--tls" in sys.argv[1:] else ([], None)
        print(f"{'groups':>7} {'ShardedModule ms':>17} {'torch ms':>9} {'per group us':>13} {'ratio':>7}"
              f"{'   (servers in TLS)' if ca else ''}{'   (each layer with a BatchNorm1d)' if BATCHNORM else ''}"
              f"{'   (reshard_after_forward)' if RESHARD else ''}")
        with flatshard.LocalCluster(servers=2, server_args=server_args) as cluster:
            run(cluster, batch, quick, ca)
            if RESHARD and not BATCHNORM:
                run_wide(cluster)


if __name__ == "__main__":
    main()
