"""flatshard.torch.ShardedModule against plain single-process PyTorch.

2 worker processes x 3 servers (or 4 in 2 replica groups: hybrid sharding): each worker
computes gradients on its half of the batch; the servers average them and run the optimizer. A single process runs the same
model with torch.optim on the whole batch (mean loss = average of the half-batch means).
Parameters must agree within 1e-5 relative error (||ours - torch|| / ||torch|| per
tensor) after every run, and the loss curves to the same bound. MisuseAndRecoveryTest:
a one-worker job with failures injected into its transfers, and a misused backward.
"""

import collections
import contextlib
import math
import multiprocessing
import os
import signal
import tempfile
import threading
import time
import unittest
import warnings
from unittest import mock

import numpy as np
import torch
import torch.nn.functional as F

import checked_cluster
import flatshard
import parity_worker
import models
from models import make_data, make_model, make_scheduler
from safetensors_reader import read_safetensors

REL_TOL = 1e-5
# The servers' memory tier where a test names none: FLATSHARD_TEST_MEMORY=device|pinned
# runs the suite over a GPU tier (on a machine with one).
MEMORY = os.environ.get("FLATSHARD_TEST_MEMORY") or "host"


def relative_error(ours, reference):
    ours, reference = torch.as_tensor(ours).double(), torch.as_tensor(reference).double()
    return ((ours - reference).norm() / reference.norm().clamp_min(1e-30)).item()


def train_side_by_side(model, reference, optimizer, x, y, steps):
    """`steps` steps on batch (x, y) of a ShardedModule and of torch's `reference` model
    with its `optimizer`."""
    for _ in range(steps):
        F.mse_loss(model(x), y).backward()
        model.step()
        optimizer.zero_grad()
        F.mse_loss(reference(x), y).backward()
        optimizer.step()


# A flatshard run: per-step losses (the workers' mean), worker 0's final state dict, the
# groups, (a clipped job) per-step gradient norms as worker 0 read them, and (with a
# GradScaler) each worker's final loss scale.
Run = collections.namedtuple("Run", "losses state groups norms scales")


def train_reference(kind, make_optimizer, steps, max_grad_norm=None, device="cpu", lr_schedule=None,
                    skip_step=None, param_groups=None, scheduler=None):
    """torch alone: the model, per-step losses and (clipped) clip_grad_norm_'s norms;
    `skip_step` goes without optimizer.step(), as GradScaler skips a non-finite one.
    `param_groups` (ShardedModule's, parameters by name) become torch's param groups 1.."""
    torch.manual_seed(0)
    model = make_model(kind).to(device)
    params = model.parameters()
    if param_groups:  # the parameters in no entry first: entry k is torch's group k + 1
        named = dict(model.named_parameters())
        listed = {name for entry in param_groups for name in entry["params"]}
        params = [{"params": [p for name, p in named.items() if name not in listed]}] + [
            dict(entry, params=[named[name] for name in entry["params"]]) for entry in param_groups]
    optimizer = make_optimizer(params)
    schedule = make_scheduler(scheduler, optimizer, steps) if scheduler else None
    x, y = (t.to(device) for t in make_data(kind))
    losses, norms = [], []
    for step in range(steps):
        if lr_schedule and step in lr_schedule:
            lr, entry = lr_schedule[step] if isinstance(lr_schedule[step], tuple) else (lr_schedule[step], None)
            for k, param_group in enumerate(optimizer.param_groups):
                if entry is None or k == entry + 1:
                    param_group["lr"] = lr
        loss = F.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        if step == skip_step:
            norms.append(float("nan"))
            losses.append(loss.item())
            continue
        if max_grad_norm:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm).item())
        optimizer.step()
        if schedule:
            schedule.step()
        losses.append(loss.item())
    return model, losses, norms


def train_flatshard(cluster, kind, optimizer, steps, job=None, param_dtype=None, device="cpu",
                    micro_batches=1, lr_schedule=None, poison_step=None, grad_scaler=False, param_groups=None,
                    scheduler=None, reshard_after_forward=False):
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    workers = [context.Process(target=parity_worker.run,
                               args=(cluster.addresses, cluster.token, rank, kind, optimizer,
                                     job or {}, steps, param_dtype, queue, device, micro_batches,
                                     lr_schedule, poison_step, grad_scaler, param_groups, scheduler,
                                     reshard_after_forward))
               for rank in range(2)]
    for worker in workers:
        worker.start()
    results = {}
    try:
        for _ in workers:
            rank, result, error = queue.get(timeout=300)
            if error:
                raise AssertionError(f"worker {rank} failed: {error}")
            results[rank] = result
    finally:
        for worker in workers:
            worker.join(timeout=30)
            if worker.is_alive():
                worker.kill()
    losses = [(a + b) / 2 for a, b in zip(results[0][0], results[1][0])]
    return Run(losses, results[0][1], results[0][2], results[0][3], [results[0][4], results[1][4]])


class ParityTest(unittest.TestCase):
    def check(self, kind, optimizer, make_reference_optimizer, steps, max_grad_norm=None,
              device="cpu", memory=MEMORY, micro_batches=1, lr_schedule=None, servers=3,
              replicas=1, poison_step=None, grad_scaler=False, param_groups=None, scheduler=None,
              reshard_after_forward=False):
        job = {"max_grad_norm": max_grad_norm} if max_grad_norm else {}
        if replicas > 1:
            job["replicas"] = replicas
        if poison_step is not None:
            job["skip_nonfinite"] = True
        with checked_cluster.LocalCluster(servers=servers, memory=memory) as cluster:
            losses, state, groups, norms, scales = train_flatshard(
                cluster, kind, optimizer, steps, job, device=device, micro_batches=micro_batches,
                lr_schedule=lr_schedule, poison_step=poison_step, grad_scaler=grad_scaler,
                param_groups=param_groups, scheduler=scheduler, reshard_after_forward=reshard_after_forward)
            if replicas > 1:  # server r holds shard r % S in replica group r // S
                status = flatshard.Client(cluster.addresses, token=cluster.token).status()
                per_replica = servers // replicas
                for rank, server in enumerate(status["servers"]):
                    rows = [g for g in server["groups"] if g["job"] == "parity"]
                    self.assertTrue(rows, server)
                    for row in rows:
                        self.assertEqual(row.get("replica", 0), rank // per_replica, row)
                        self.assertEqual(row.get("shard", 0), rank % per_replica, row)
            if memory == "device" and device == "cuda":  # every transfer went over CUDA IPC
                status = flatshard.Client(cluster.addresses, token=cluster.token).status()
                # Each trained group's gradient, once a step from each worker, to each server
                # of its replica group.
                trained = sum(1 for _, path, _ in groups if path is not None)
                for server in status["servers"]:
                    self.assertEqual(int(server["ipc_scatters"]), steps * trained * 2 // replicas, server)
                    self.assertGreater(int(server["ipc_gathers"]), 0, server)
        reference, reference_losses, reference_norms = train_reference(
            kind, make_reference_optimizer, steps, max_grad_norm, device, lr_schedule,
            skip_step=poison_step, param_groups=param_groups, scheduler=scheduler)
        # The servers' norm of each step is clip_grad_norm_'s; a skipped step's is not finite.
        self.assertEqual(len(norms), len(reference_norms))
        for step, (ours, theirs) in enumerate(zip(norms, reference_norms)):
            if step == poison_step:
                self.assertFalse(math.isfinite(ours), f"gradient norm at the poisoned step {step}")
                continue
            self.assertLess(abs(ours - theirs) / theirs, REL_TOL, f"gradient norm at step {step}")
        self.assertGreater(len(groups), 1, "the auto-wrap policy should make several groups")
        for step, (ours, theirs) in enumerate(zip(losses, reference_losses)):
            self.assertLess(abs(ours - theirs) / abs(theirs), REL_TOL, f"loss at step {step}")
        reference_state = {k: v.cpu() for k, v in reference.state_dict().items()}
        self.assertEqual(set(state), set(reference_state))
        for name, value in reference_state.items():
            self.assertLess(relative_error(state[name], value), REL_TOL, name)
        # The run moved the parameters well past the tolerance: the test can fail.
        initial = make_model(kind).state_dict()
        moved = max(relative_error(state[n], initial[n]) for n in initial)
        self.assertGreater(moved, 100 * REL_TOL)
        return Run(losses, state, groups, norms, scales)

    def test_mlp_adamw_weight_decay_and_clipping(self):
        self.check("mlp", flatshard.AdamW(lr=1e-2, weight_decay=0.05),
                   lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.05), 20, max_grad_norm=0.5)

    def test_transformer_block_adamw_weight_decay_and_clipping(self):
        self.check("transformer", flatshard.AdamW(lr=5e-3, weight_decay=0.01),
                   lambda p: torch.optim.AdamW(p, lr=5e-3, weight_decay=0.01), 20, max_grad_norm=0.5)

    def test_activation_checkpointing(self):
        # The MLP's forward runs again in backward (its groups' pre-hooks fire twice).
        self.check("checkpointed", flatshard.AdamW(lr=5e-3, weight_decay=0.01),
                   lambda p: torch.optim.AdamW(p, lr=5e-3, weight_decay=0.01), 10, max_grad_norm=0.5)

    def test_sgd_momentum_nesterov(self):
        self.check("mlp", flatshard.SGD(lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3),
                   lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True,
                                             weight_decay=1e-3), 20)

    def test_modules_used_functionally_get_their_parameters(self):
        self.check("attention", flatshard.SGD(lr=0.05, momentum=0.9),
                   lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9), 10)

    def test_weights_used_outside_their_modules_get_their_parameters(self):
        self.check("reused", flatshard.SGD(lr=0.05, momentum=0.9),
                   lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9), 8)

    def test_tied_and_frozen_parameters(self):
        # Parity covers the rest: torch counts the tied weight once in the norm, gives it
        # the sum of both uses' gradients, and skips the frozen projection (no gradient, so
        # no weight decay either).
        losses, state, groups, _, _ = self.check(
            "tied_frozen", flatshard.AdamW(lr=1e-2, weight_decay=0.05),
            lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.05), 20, max_grad_norm=0.5)
        self.assertLess(losses[-1], losses[0])
        stored = [fqn for _, _, names in groups for fqn in names]
        self.assertEqual(sorted(stored), sorted(set(stored)))  # no tensor in two groups
        self.assertIn("embed.weight", stored)
        self.assertNotIn("unembed.weight", stored)  # the tied name: an alias, not a copy
        np.testing.assert_array_equal(state["unembed.weight"], state["embed.weight"])
        initial = make_model("tied_frozen").state_dict()
        for name in ("project.weight", "project.bias"):
            self.assertIn(name, stored)  # on the servers, so checkpoints hold it
            self.assertTrue(torch.equal(torch.from_numpy(state[name]), initial[name]), name)

    def test_gradient_accumulation_under_no_sync(self):
        # 4 micro-batches per worker, 3 accumulated locally: the same steps as one batch.
        self.check("transformer", flatshard.AdamW(lr=5e-3, weight_decay=0.01),
                   lambda p: torch.optim.AdamW(p, lr=5e-3, weight_decay=0.01), 10,
                   max_grad_norm=0.5, micro_batches=4)

    def test_a_learning_rate_schedule_applies_from_the_next_step(self):
        # Frozen parameters too: set_hyperparams must leave their group alone.
        self.check("tied_frozen", flatshard.AdamW(lr=1e-2, weight_decay=0.05),
                   lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.05), 12,
                   lr_schedule={4: 3e-2, 8: 1e-3})

    def test_param_groups_set_weight_decay_and_learning_rate_per_parameter(self):
        # A transformer recipe: no weight decay on biases and norms, the head at its own
        # learning rate; the schedule changes every parameter's, then the head's alone.
        no_decay = [name for name, p in make_model("transformer").named_parameters()
                    if p.ndim < 2 and not name.startswith("head.")]
        param_groups = [{"params": no_decay, "weight_decay": 0.0},
                        {"params": ["head.weight", "head.bias"], "lr": 2e-2}]
        run = self.check("transformer", flatshard.AdamW(lr=5e-3, weight_decay=0.1),
                         lambda groups: torch.optim.AdamW(groups, lr=5e-3, weight_decay=0.1), 12,
                         max_grad_norm=0.5, lr_schedule={4: 3e-3, 8: (1e-2, 1)}, param_groups=param_groups)
        # A flat parameter per wrapped module and entry: one optimizer setting each.
        entry_of = {name: k for k, entry in enumerate(param_groups) for name in entry["params"]}
        names = []
        for group, _, fqns in run.groups:
            names.append(group)
            entries = {entry_of.get(fqn) for fqn in fqns}
            self.assertEqual(len(entries), 1, (group, fqns))
            entry = entries.pop()
            self.assertEqual(group.endswith(f".<param_groups[{entry}]>"), entry is not None, group)
        self.assertIn("model.query", names)
        self.assertIn("model.query.<param_groups[0]>", names)
        self.assertIn("model.<root>.<param_groups[1]>", names)

    def test_torch_schedulers_drive_the_servers_optimizer_through_server_optimizer(self):
        # OneCycleLR sets every param group's lr and AdamW's beta1 at every step, each group
        # to its own values: through ServerOptimizer's param_groups as through torch's.
        no_decay = [name for name, p in make_model("transformer").named_parameters()
                    if p.ndim < 2 and not name.startswith("head.")]
        self.check("transformer", flatshard.AdamW(lr=5e-3, weight_decay=0.1),
                   lambda groups: torch.optim.AdamW(groups, lr=5e-3, weight_decay=0.1), 12,
                   max_grad_norm=0.5, scheduler="onecycle",
                   param_groups=[{"params": no_decay, "weight_decay": 0.0},
                                 {"params": ["head.weight", "head.bias"], "lr": 2e-2}])

    def test_hybrid_sharding_two_replica_groups(self):
        # 4 servers in 2 replica groups of 2, one worker in each: each worker gathers from
        # its own replica group, the servers add the replica groups' gradients.
        self.check("transformer", flatshard.AdamW(lr=5e-3, weight_decay=0.01),
                   lambda p: torch.optim.AdamW(p, lr=5e-3, weight_decay=0.01), 10,
                   max_grad_norm=0.5, servers=4, replicas=2)

    def test_hybrid_sharding_with_tied_frozen_parameters_and_accumulation(self):
        self.check("tied_frozen", flatshard.AdamW(lr=1e-2, weight_decay=0.05),
                   lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.05), 10,
                   max_grad_norm=0.5, micro_batches=2, servers=4, replicas=2)

    def test_a_non_finite_step_is_skipped_as_grad_scaler_skips_it(self):
        # Worker 1's gradients turn inf/NaN at step 4: the servers skip that step (Adam's
        # step count included), and training goes on as torch's does without it.
        self.check("transformer", flatshard.AdamW(lr=5e-3, weight_decay=0.01),
                   lambda p: torch.optim.AdamW(p, lr=5e-3, weight_decay=0.01), 10,
                   max_grad_norm=0.5, poison_step=4)

    def test_grad_scaler_scales_backs_off_on_the_skipped_step_and_grows(self):
        # Power-of-two scales are exact in fp32, so the run still matches torch without
        # scaling, step 4 skipped. Scale 2**10: x2 after steps 0-2, /2 at step 4 (skipped),
        # x2 after steps 5-7.
        run = self.check("transformer", flatshard.AdamW(lr=5e-3, weight_decay=0.01),
                         lambda p: torch.optim.AdamW(p, lr=5e-3, weight_decay=0.01), 10,
                         max_grad_norm=0.5, poison_step=4, grad_scaler=True)
        self.assertEqual(run.scales, [2.0 ** 11, 2.0 ** 11])

    # FSDP's FULL_SHARD: each wrapped module's parameters freed after its forward and
    # gathered again for its backward (ReshardAfterForwardTest checks what is held when).
    def test_reshard_after_forward_transformer_clipped(self):
        self.check("transformer", flatshard.AdamW(lr=5e-3, weight_decay=0.01),
                   lambda p: torch.optim.AdamW(p, lr=5e-3, weight_decay=0.01), 10, max_grad_norm=0.5,
                   reshard_after_forward=True)

    def test_reshard_after_forward_with_activation_checkpointing(self):
        # The MLP's forward runs again in backward, where its groups stay gathered.
        self.check("checkpointed", flatshard.AdamW(lr=5e-3, weight_decay=0.01),
                   lambda p: torch.optim.AdamW(p, lr=5e-3, weight_decay=0.01), 8, reshard_after_forward=True)

    def test_reshard_after_forward_with_modules_used_functionally(self):
        # (SGD: MultiheadAttention's key bias has a gradient of rounding noise, which Adam amplifies.)
        self.check("attention", flatshard.SGD(lr=0.05, momentum=0.9),
                   lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9), 8, reshard_after_forward=True)

    def test_reshard_after_forward_with_weights_used_outside_their_modules(self):
        self.check("reused", flatshard.SGD(lr=0.05, momentum=0.9),
                   lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9), 8, reshard_after_forward=True)

    def test_reshard_after_forward_tied_frozen_and_accumulated(self):
        self.check("tied_frozen", flatshard.SGD(lr=0.05, momentum=0.9),
                   lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9), 8, micro_batches=2,
                   reshard_after_forward=True)

    def test_reshard_after_forward_frozen_layers_under_adapters(self):
        # LoRA: each layer's frozen base a group of its own, freed alike.
        self.check("lora", flatshard.AdamW(lr=1e-2, weight_decay=0.01),
                   lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.01), 10, max_grad_norm=0.5,
                   reshard_after_forward=True)

    def test_adam(self):
        self.check("mlp", flatshard.Adam(lr=1e-2, betas=(0.8, 0.99), weight_decay=1e-3),
                   lambda p: torch.optim.Adam(p, lr=1e-2, betas=(0.8, 0.99), weight_decay=1e-3), 20)

    @unittest.skipUnless(torch.cuda.is_available(), "no CUDA device for torch on this machine")
    def test_cuda_model_with_gpu_servers_over_cuda_ipc(self):
        # Workers and --memory=device servers share the GPU: every transfer is CUDA IPC.
        self.check("transformer", flatshard.AdamW(lr=5e-3, weight_decay=0.01),
                   lambda p: torch.optim.AdamW(p, lr=5e-3, weight_decay=0.01), 20,
                   max_grad_norm=0.5, device="cuda", memory="device")

    @unittest.skipUnless(torch.cuda.is_available(), "no CUDA device for torch on this machine")
    def test_cuda_model_grad_scaler_with_gpu_servers(self):
        # As the CPU GradScaler test, the gradients in GPU memory and on the device tier.
        run = self.check("transformer", flatshard.AdamW(lr=5e-3, weight_decay=0.01),
                         lambda p: torch.optim.AdamW(p, lr=5e-3, weight_decay=0.01), 10,
                         max_grad_norm=0.5, poison_step=4, grad_scaler=True, device="cuda",
                         memory="device")
        self.assertEqual(run.scales, [2.0 ** 11, 2.0 ** 11])

    @unittest.skipUnless(torch.cuda.is_available(), "no CUDA device for torch on this machine")
    def test_cuda_model_resharded_after_forward_on_the_gpu_tiers(self):
        # The flat buffers freed and restored are GPU memory: gathered again over CUDA IPC
        # (device tier) or through pinned staging (pinned tier), with activation checkpointing.
        for memory in ("device", "pinned"):
            with self.subTest(memory=memory):
                self.check("checkpointed", flatshard.AdamW(lr=5e-3, weight_decay=0.01),
                           lambda p: torch.optim.AdamW(p, lr=5e-3, weight_decay=0.01), 8, max_grad_norm=0.5,
                           device="cuda", memory=memory, reshard_after_forward=True)

    @unittest.skipUnless(torch.cuda.is_available(), "no CUDA device for torch on this machine")
    def test_cuda_model_hybrid_tied_frozen_on_the_gpu_tiers(self):
        # Replica groups exchanging reduced gradients on the device tier (over CUDA IPC) and
        # on the pinned tier (over TCP from pinned staging), with a frozen group.
        for memory in ("device", "pinned"):
            with self.subTest(memory=memory):
                self.check("tied_frozen", flatshard.AdamW(lr=1e-2, weight_decay=0.05),
                           lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.05), 10,
                           max_grad_norm=0.5, micro_batches=2, servers=4, replicas=2,
                           device="cuda", memory=memory)


def one_worker_mlp_on(cluster, job, kind="mlp", **options):
    """(client, ShardedModule of the MLP (or model `kind`) with SGD) of a one-worker job on
    `cluster`."""
    import flatshard.torch
    client = flatshard.Client(cluster.addresses, token=cluster.token, job=job)
    client.configure_job()
    return client, flatshard.torch.ShardedModule(make_model(kind), client, flatshard.SGD(lr=0.1),
                                                 auto_wrap_min_params=200, **options)


@contextlib.contextmanager
def one_worker_mlp(job, **options):
    """one_worker_mlp_on a cluster of 2 servers of its own."""
    with checked_cluster.LocalCluster(servers=2, memory=MEMORY) as cluster:
        yield one_worker_mlp_on(cluster, job, **options)


class Failed:
    """A transfer's future that raises `error` when waited on."""

    def __init__(self, error):
        self.error = error

    def wait(self):
        raise self.error

    def done(self):
        return True


def fail_first_scatter(client, victim, error, arrives):
    """Makes the first scatter of group `victim` fail with `error`: before it is sent, or
    (`arrives`) after the servers took it, as when only the answer is lost. Returns the
    list of group names scattered, in order (scatter_async and scatter_many_async both)."""
    real_one, real_many, sent = client.scatter_async, client.scatter_many_async, []

    def inject(names, grads, real, *a, **k):
        firsts = []
        for name in names:
            sent.append(name)
            firsts.append(name == victim and sent.count(name) == 1)
        kept = [i for i, first in enumerate(firsts) if arrives or not first]
        started = iter(real([names[i] for i in kept], [grads[i] for i in kept], *a, **k))
        transfers = []
        for first in firsts:
            if first and not arrives:
                transfers.append(Failed(error))
                continue
            transfer = next(started)
            if first:
                transfer.wait()  # the gradient arrives; its answer does not
                transfer = Failed(error)
            transfers.append(transfer)
        return transfers

    def real_single(names, grads, *a, **k):
        return [real_one(name, grad, *a, **k) for name, grad in zip(names, grads)]

    client.scatter_many_async = lambda names, grads, *a, **k: inject(names, grads, real_many, *a, **k)
    client.scatter_async = lambda name, grads, *a, **k: inject([name], [grads], real_single, *a, **k)[0]
    return sent


class MatchesSgd:
    """For test cases whose one-worker modules (one_worker_mlp_on) train with SGD(lr=0.1)."""

    def assert_matches_sgd(self, state, steps, kind="mlp"):
        """`state` is what torch.optim.SGD(lr=0.1) makes of the MLP (or model `kind`) in
        `steps` steps."""
        reference, _, _ = train_reference(kind, lambda p: torch.optim.SGD(p, lr=0.1), steps)
        for name, value in reference.state_dict().items():
            self.assertLess(relative_error(state[name], value), REL_TOL, name)


class MisuseAndRecoveryTest(MatchesSgd, unittest.TestCase):

    def test_delete_job_leaves_nothing_of_the_module_on_the_servers(self):
        with one_worker_mlp("finished") as (client, model):
            x, y = make_data("mlp")
            F.mse_loss(model(x), y).backward()
            model.step()
            held = sum(int(g["bytes"]) for s in client.status()["servers"] for g in s["groups"])
            freed = model.delete_job()  # the groups and the barrier's
            # As status counted them (a snapshot an old reader let go since would add one).
            self.assertGreater(held, 0)
            self.assertLessEqual(held, freed)
            self.assertLess(freed, 2 * held)
            status = client.status()
            self.assertEqual([g for s in status["servers"] for g in s["groups"]], [])
            self.assertEqual([j for s in status["servers"] for j in s.get("jobs", [])], [])

    def test_a_module_without_parameters_wraps_runs_and_steps(self):
        with checked_cluster.LocalCluster(servers=2, memory=MEMORY) as cluster:
            client = flatshard.Client(cluster.addresses, token=cluster.token, job="no-params")
            client.configure_job()
            model = flatshard.torch.ShardedModule(torch.nn.ReLU(), client, optimizer=flatshard.SGD(lr=0.1))
            self.assertEqual(model.groups, [])
            self.assertEqual(model(torch.tensor([-1.0, 2.0])).tolist(), [0.0, 2.0])
            model.set_hyperparams(lr=0.2)
            model.step()
            self.assertEqual(model.version, 1)
            self.assertEqual(model.state_dict(), {})
            self.assertEqual(model.optim_state_dict()["state"], {})

    def test_param_groups_that_do_not_fit_the_module_are_refused_before_registering(self):
        with checked_cluster.LocalCluster(servers=2, memory=MEMORY) as cluster:
            client = flatshard.Client(cluster.addresses, token=cluster.token, job="param-groups")
            client.configure_job()
            stranger = torch.nn.Linear(2, 3).weight
            for param_groups, message in [
                    ([{"lr": 0.1}], "param_groups[0]: expected a dict with 'params'"),
                    ([{"params": ["0.bias"], "betas": (0.9, 0.9)}],
                     "param_groups[0]: unknown hyper-parameters ['betas'] for SGD"),
                    ([{"params": ["0.bias"]}, {"params": ["2.bias", "0.bias"]}],
                     "parameter '0.bias' is in param_groups[0] and param_groups[1]"),
                    ([{"params": ["0.gamma"]}], "param_groups[0]: '0.gamma' is not a parameter of the module"),
                    ([{"params": [stranger]}],
                     "param_groups[0]: a tensor of shape (3, 2) that is not one of the module's parameters")]:
                with self.subTest(message=message):
                    with self.assertRaises(flatshard.InvalidArgumentError) as refused:
                        flatshard.torch.ShardedModule(make_model("mlp"), client, flatshard.SGD(lr=0.1),
                                                      auto_wrap_min_params=200, param_groups=param_groups)
                    self.assertIn(message, str(refused.exception))
            self.assertEqual([g for s in client.status()["servers"] for g in s["groups"]], [])
            # Parameters given as tensors; lr 0 keeps the head's weight where it was.
            net = make_model("mlp")
            head = net[4].weight
            initial = head.detach().clone()
            model = flatshard.torch.ShardedModule(net, client, flatshard.SGD(lr=0.1), auto_wrap_min_params=200,
                                                  param_groups=[{"params": head, "lr": 0.0}])
            x, y = make_data("mlp")
            F.mse_loss(model(x), y).backward()
            model.step()
            state = model.state_dict()
            self.assertTrue(torch.equal(state["4.weight"], initial))
            self.assertFalse(torch.equal(state["4.bias"], make_model("mlp")[4].bias))
            with self.assertRaises(flatshard.InvalidArgumentError) as refused:
                model.set_hyperparams(param_group=1, lr=0.2)
            self.assertIn("param_group 1: the module has 1 param_groups", str(refused.exception))
            # ServerOptimizer's param_groups: the parameters in no entry, then the entry's.
            optimizer = flatshard.torch.ServerOptimizer(model)
            self.assertEqual([sorted(id(p) for p in g["params"]) for g in optimizer.param_groups],
                             [sorted(id(p) for n, p in net.named_parameters() if n != "4.weight"), [id(head)]])
            self.assertEqual([g["lr"] for g in optimizer.param_groups], [0.1, 0.0])
            with self.assertRaises(flatshard.InvalidArgumentError) as refused:
                flatshard.torch.ServerOptimizer(net)
            self.assertIn("not a Sequential", str(refused.exception))
            self.assertEqual([g["lr"] for g in optimizer.state_dict()["param_groups"]], [0.1, 0.0])
            with self.assertRaises(flatshard.InvalidArgumentError) as refused:
                optimizer.load_state_dict({"state": {}, "param_groups": [{}]})
            self.assertIn("the state dict has 1 param_groups; this optimizer has 2", str(refused.exception))

    def test_a_checkpoint_loads_into_a_module_wrapped_otherwise(self):
        # FULL and SHARDED checkpoints load by tensor: a module wrapped into other groups
        # (another auto-wrap size, param groups added) resumes the saved run, and training
        # goes on as torch's of all the steps. SGD's settings are the same in every entry.
        import flatshard.torch
        x, y = make_data("mlp")
        with tempfile.TemporaryDirectory() as root, \
                checked_cluster.LocalCluster(servers=2, checkpoint_root=root, memory=MEMORY) as cluster:
            client, model = one_worker_mlp_on(cluster, "saved")
            for _ in range(2):
                F.mse_loss(model(x), y).backward()
                model.step()
            saved = {name: torch.as_tensor(value) for name, value in model.state_dict().items()}
            for kind in ("full", "sharded"):
                client.save_checkpoint(kind, kind=kind)
            for kind in ("full", "sharded"):
                with self.subTest(kind=kind):
                    resumed = flatshard.Client(cluster.addresses, token=cluster.token, job=f"resumed-{kind}")
                    resumed.configure_job()
                    net = make_model("mlp")
                    biases = [p for p in net.parameters() if p.ndim < 2]
                    other = flatshard.torch.ShardedModule(
                        net, resumed, flatshard.SGD(lr=0.1), auto_wrap_min_params=1000, load_checkpoint=kind,
                        param_groups=[{"params": biases, "weight_decay": 0.0}])
                    self.assertNotEqual(sorted(g for g, _, _ in other.groups), sorted(g for g, _, _ in model.groups))
                    self.assertEqual(other.version, 2)
                    for name, value in other.state_dict().items():
                        self.assertTrue(torch.equal(torch.as_tensor(value), saved[name]), name)
                    F.mse_loss(other(x), y).backward()
                    other.step()
                    self.assert_matches_sgd(other.state_dict(), steps=3)

    def test_a_model_with_a_new_head_fine_tunes_from_a_checkpoint_loaded_non_strictly(self):
        # Fine-tuning: the transformer's checkpoint (weights only) loads non-strictly into
        # the block with its head replaced: what is left out is what torch's
        # load_state_dict(strict=False) leaves out, the new head (a group of its own, and
        # part of the root's) keeps its initial values, and AdamW from there is torch's;
        # also with the pretrained body frozen (linear probing: the frozen group loads, the
        # trained head stays at version 0).
        import flatshard.torch
        x, y = make_data("transformer")
        with tempfile.TemporaryDirectory() as root, \
                checked_cluster.LocalCluster(servers=2, checkpoint_root=root, memory=MEMORY) as cluster:
            client = flatshard.Client(cluster.addresses, token=cluster.token, job="pretrain")
            client.configure_job()
            pretrained = flatshard.torch.ShardedModule(make_model("transformer"), client, flatshard.AdamW(lr=1e-2),
                                                       auto_wrap_min_params=200)
            for _ in range(2):
                F.mse_loss(pretrained(x), y).backward()
                pretrained.step()
            client.save_checkpoint("pretrained", kind="full", optimizer=False)
            weights = {name: torch.as_tensor(value).clone() for name, value in pretrained.state_dict().items()}
            for frozen_body in (False, True):
                with self.subTest(frozen_body=frozen_body):
                    def retargeted():
                        net = make_model("retargeted")
                        for name, param in net.named_parameters():
                            param.requires_grad_(not frozen_body or name.startswith("task_head."))
                        return net
                    reference = retargeted()
                    expected = reference.load_state_dict(weights, strict=False)
                    self.assertTrue(expected.missing_keys and expected.unexpected_keys)
                    tuner = flatshard.Client(cluster.addresses, token=cluster.token, job=f"tune-{frozen_body}")
                    tuner.configure_job()
                    adamw = flatshard.AdamW(lr=5e-3, weight_decay=0.1)
                    with self.assertRaises(flatshard.FailedPreconditionError) as refused:  # strict: all or nothing
                        flatshard.torch.ShardedModule(retargeted(), tuner, adamw, auto_wrap_min_params=200,
                                                      load_checkpoint="pretrained")
                    self.assertIn("is not in checkpoint 'pretrained'", str(refused.exception))
                    model = flatshard.torch.ShardedModule(retargeted(), tuner, adamw, auto_wrap_min_params=200,
                                                          load_checkpoint="pretrained", load_strict=False)
                    self.assertEqual(sorted(model.load_result.missing_keys), sorted(expected.missing_keys))
                    self.assertEqual(sorted(model.load_result.unexpected_keys), sorted(expected.unexpected_keys))
                    self.assertIn(["task_head.0.weight", "task_head.0.bias"], [fqns for _, _, fqns in model.groups])
                    self.assertEqual(model.version, 0 if frozen_body else 2)
                    frozen = [fqn for _, path, fqns in model.groups if path is None for fqn in fqns]
                    self.assertEqual("embed.weight" in frozen, frozen_body)
                    for name, value in reference.state_dict().items():
                        self.assertTrue(torch.equal(torch.as_tensor(model.state_dict()[name]), value), name)
                    optimizer = torch.optim.AdamW(reference.parameters(), lr=5e-3, weight_decay=0.1)
                    train_side_by_side(model, reference, optimizer, x, y, steps=3)
                    state = model.state_dict()
                    for name, value in reference.state_dict().items():
                        self.assertLess(relative_error(state[name], value), REL_TOL, name)
                    if frozen_body:
                        self.assertTrue(torch.equal(torch.as_tensor(state["embed.weight"]), weights["embed.weight"]))

    def test_a_parameter_unfrozen_after_wrapping_is_refused_at_step_not_left_untrained(self):
        with checked_cluster.LocalCluster(servers=2, memory=MEMORY) as cluster:
            client = flatshard.Client(cluster.addresses, token=cluster.token, job="unfrozen")
            client.configure_job()
            net = make_model("tied_frozen")
            model = flatshard.torch.ShardedModule(net, client, flatshard.SGD(lr=0.1), auto_wrap_min_params=200)
            x, y = make_data("tied_frozen")
            F.mse_loss(model(x), y).backward()
            model.step()
            net.project.requires_grad_(True)
            F.mse_loss(model(x), y).backward()
            with self.assertRaises(flatshard.FailedPreconditionError) as refused:
                model.step()
            self.assertIn("parameter 'project.weight' has a gradient, but it was frozen", str(refused.exception))
            self.assertEqual(model.version, 1)
            other = flatshard.Client(cluster.addresses, token=cluster.token, job="rewrapped")
            other.configure_job()
            with self.assertRaises(flatshard.InvalidArgumentError) as refused:  # the old hooks would fire
                flatshard.torch.ShardedModule(net, other, flatshard.SGD(lr=0.1))
            self.assertIn("this TiedFrozenModel is wrapped by a ShardedModule already", str(refused.exception))

    def test_a_second_backward_outside_no_sync_is_refused(self):
        with one_worker_mlp("twice") as (_, model):
            x, y = make_data("mlp")
            F.mse_loss(model(x), y).backward()
            with self.assertRaises(flatshard.FailedPreconditionError) as refused:
                F.mse_loss(model(x), y).backward()
            self.assertIn("call step() before the next backward", refused.exception.message)

    def test_a_failed_gather_is_issued_again_by_the_next_forward(self):
        with one_worker_mlp("retry") as (client, model):
            x, _ = make_data("mlp")
            real, issued = client.gather_many_async, []
            injected = flatshard.UnavailableError("injected: the server went away")
            client.gather_many_async = lambda names, *a, **k: issued.extend(names) or [Failed(injected) for _ in names]
            with self.assertRaises(flatshard.UnavailableError):
                model(x)
            failed = list(issued)
            with torch.no_grad():  # what a transfer that broke off may leave behind
                for group in model._groups:
                    group.flat.fill_(float("nan"))
            client.gather_many_async = lambda names, *a, **k: issued.extend(names) or real(names, *a, **k)
            expected = make_model("mlp")(x)
            self.assertTrue(torch.equal(model(x), expected))  # gathered again, not stale
            self.assertEqual(sorted(issued[len(failed):]), sorted(failed))

    def test_a_failed_step_sends_again_only_what_did_not_arrive(self):
        with one_worker_mlp("resend") as (client, model):
            x, y = make_data("mlp")
            victim = model.groups[1][0]
            sent = fail_first_scatter(client, victim, arrives=False,
                                      error=flatshard.DeadlineExceededError("injected: the transfer timed out"))
            F.mse_loss(model(x), y).backward()
            with self.assertRaises(flatshard.DeadlineExceededError):
                model.step()
            self.assertEqual(model.version, 0)
            first = len(sent)
            model.step()  # the retry
            self.assertEqual(sent[first:], [victim])
            self.assertEqual(model.version, 1)
            F.mse_loss(model(x), y).backward()  # and training goes on
            model.step()
            state = model.state_dict()
        self.assert_matches_sgd(state, steps=2)

    def test_a_step_whose_answer_was_lost_completes_when_retried(self):
        with one_worker_mlp("lost") as (client, model):
            x, y = make_data("mlp")
            victim = model.groups[0][0]
            sent = fail_first_scatter(client, victim, arrives=True,
                                      error=flatshard.DeadlineExceededError("injected: the answer was lost"))
            F.mse_loss(model(x), y).backward()
            with self.assertRaises(flatshard.DeadlineExceededError):
                model.step()
            model.step()  # the servers answer the resend: they hold it already
            self.assertEqual(sent.count(victim), 2)
            self.assertEqual(model.version, 1)
            state = model.state_dict()
        self.assert_matches_sgd(state, steps=1)

    def test_ctrl_c_in_a_step_cancels_its_scatters_and_the_retry_completes_it(self):
        with checked_cluster.LocalCluster(servers=2, memory=MEMORY) as cluster:
            client, model = one_worker_mlp_on(cluster, "interrupted")
            self.assertGreater(len(model.groups), 1)
            x, y = make_data("mlp")
            loss = F.mse_loss(model(x), y)
            # Every group's scatter (sent as backward reaches it) waits for server 0's
            # answer, up to the client's 30 s each: Ctrl-C in the first wait cancels the
            # others too.
            cluster.pause(0)
            loss.backward()
            timer = threading.Timer(0.3, signal.pthread_kill, args=(threading.get_ident(), signal.SIGINT))
            try:
                start = time.monotonic()
                timer.start()
                with self.assertRaises(KeyboardInterrupt):
                    model.step()
                self.assertLess(time.monotonic() - start, 10.0)
            finally:
                timer.join()
                cluster.resume(0)
            self.assertEqual(model.version, 0)
            model.step()  # sent again where the cancelled scatters had not arrived
            self.assertEqual(model.version, 1)
            state = model.state_dict()
            del model, client
        self.assert_matches_sgd(state, steps=1)

    # An operator loads checkpoints while two workers train: back to version 0 while worker
    # 0's step waits for worker 1, back to 0 between steps, and forward to 3 in the middle
    # of a step. Each time the module raises AbortedError from step() or forward, at the
    # loaded version, and training from there matches torch.
    def test_a_load_during_training_moves_the_module_to_the_loaded_version(self):
        import flatshard.torch
        with tempfile.TemporaryDirectory() as root, \
                checked_cluster.LocalCluster(servers=2, checkpoint_root=root, memory=MEMORY) as cluster:
            clients = [flatshard.Client(cluster.addresses, worker_rank=r, num_workers=2, token=cluster.token,
                                        job="reload") for r in range(2)]
            clients[0].configure_job()
            modules, models = [make_model("mlp") for _ in clients], [None, None]

            def wrap(rank):  # both at once: the constructor waits for every worker
                models[rank] = flatshard.torch.ShardedModule(modules[rank], clients[rank], flatshard.SGD(lr=0.1),
                                                             auto_wrap_min_params=200)

            in_parallel([lambda r=r: wrap(r) for r in range(2)])
            operator = flatshard.Client(cluster.addresses, token=cluster.token, job="reload")
            operator.save_checkpoint("start", kind="sharded")  # the initial values, version 0
            x, y = make_data("mlp")
            aborted = []

            def train(rank, retry=True):
                try:
                    F.mse_loss(models[rank](x), y).backward()
                    models[rank].step()
                except flatshard.AbortedError as e:
                    aborted.append(e.message)
                    if retry:
                        train(rank)  # the next batch, from the loaded version

            def train_both(steps=1):
                for _ in range(steps):
                    in_parallel([lambda r=r: train(r) for r in range(2)])

            # Worker 1 sends nothing: worker 0's step waits. A load before the step waits
            # does not end it; the next one does.
            stepping = threading.Thread(target=train, args=(0, False))
            stepping.start()
            for _ in range(50):
                stepping.join(0.1)
                if not stepping.is_alive():
                    break
                operator.load_checkpoint("start")
            stepping.join()
            self.assertEqual(len(aborted), 1)
            self.assertIn("while waiting for version 1", aborted[0])
            self.assertEqual(models[0].version, 0)
            with self.assertRaises(flatshard.FailedPreconditionError) as refused:
                models[0].step()  # it would send zeros for the voided step
            self.assertIn("run forward and backward on the next batch", refused.exception.message)
            train_both(steps=3)
            self.assertEqual([m.version for m in models], [3, 3])
            self.assertEqual(len(aborted), 1)
            operator.save_checkpoint("three", kind="sharded")

            operator.load_checkpoint("start")  # between steps: each worker's next forward sees it
            train_both()
            self.assertEqual(aborted[1:], ["the servers are at version 0 during step 3: a checkpoint load moved "
                                           "them; the step is void and the module resumes at their version"] * 2)
            self.assertEqual([m.version for m in models], [1, 1])
            state_after_one = models[0].state_dict()

            F.mse_loss(models[0](x), y).backward()  # worker 0 sends step 1; worker 1 has yet to
            operator.load_checkpoint("three")
            with self.assertRaises(flatshard.AbortedError):
                models[0].step()
            self.assertEqual(models[0].version, 3)
            train_both()  # worker 1's forward finds version 3 first
            self.assertEqual(len(aborted), 4)
            self.assertIn("the servers are at version 3 during step 1", aborted[3])
            self.assertEqual([m.version for m in models], [4, 4])
            state = models[0].state_dict()
        self.assert_matches_sgd(state_after_one, steps=1)
        self.assert_matches_sgd(state, steps=4)


def in_parallel(calls):
    """Runs every call on a thread of its own; raises the first failure."""
    errors = []

    def run(call):
        try:
            call()
        except BaseException as e:  # noqa: BLE001 (raised below)
            errors.append(e)

    threads = [threading.Thread(target=run, args=(call,)) for call in calls]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]


def two_workers_with_averaged_buffers(steps, lr):
    """torch alone, as two data-parallel workers whose buffers are averaged after every
    step (what ShardedModule does): two copies of the BatchNorm net, each on its half of
    the batch, stepped by SGD on the mean gradient (float64 sums)."""
    copies = [make_model("batchnorm"), make_model("batchnorm")]
    x, y = make_data("batchnorm")
    for _ in range(steps):
        for rank, model in enumerate(copies):
            model.zero_grad()
            F.mse_loss(model(x[rank * 8:(rank + 1) * 8]), y[rank * 8:(rank + 1) * 8]).backward()
        with torch.no_grad():
            for first, second in zip(copies[0].parameters(), copies[1].parameters()):
                first -= lr * ((first.grad.double() + second.grad.double()) / 2).float()
                second.copy_(first)
            for first, second in zip(copies[0].buffers(), copies[1].buffers()):
                first.copy_(((first.double() + second.double()) / 2).to(first.dtype))
                second.copy_(first)
    return copies[0]


def wrap_in_cluster(cluster, job, optimizer, rank=0, workers=1, net=None, **options):
    """(client, ShardedModule of `net`, default a new BatchNorm net) of worker `rank` of job
    `job` on `cluster`."""
    import flatshard.torch
    client = flatshard.Client(cluster.addresses, worker_rank=rank, num_workers=workers, token=cluster.token, job=job)
    client.configure_job()
    return client, flatshard.torch.ShardedModule(net or make_model("batchnorm"), client, optimizer,
                                                 auto_wrap_min_params=200, **options)


class ModuleBuffersTest(unittest.TestCase):
    """Module buffers (BatchNorm's running statistics, num_batches_tracked) on the servers:
    stepped with the parameters, the workers' mean, in state_dict, checkpoints and exports."""

    wrap = staticmethod(wrap_in_cluster)

    def test_one_worker_keeps_torchs_buffers_and_state_dict(self):
        x, y = make_data("batchnorm")
        reference = make_model("batchnorm")
        optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
        with checked_cluster.LocalCluster(servers=2, memory=MEMORY) as cluster:
            _, model = self.wrap(cluster, "bn", flatshard.AdamW(lr=1e-2))
            train_side_by_side(model, reference, optimizer, x, y, steps=4)
            state = model.state_dict()
            model.eval()
            reference.eval()
            with torch.no_grad():
                self.assertLess(relative_error(model(x), reference(x)), REL_TOL)
        expected = reference.state_dict()
        self.assertEqual(list(state), list(expected))  # torch's keys (not "scratch") in torch's order
        for name, value in expected.items():
            self.assertEqual(state[name].dtype, value.dtype, name)
            self.assertLess(relative_error(state[name], value), REL_TOL, name)
        self.assertTrue(torch.equal(state["bn.num_batches_tracked"], torch.tensor(4)))

    def test_two_workers_buffers_are_their_mean_after_each_step(self):
        x, y = make_data("batchnorm")
        with checked_cluster.LocalCluster(servers=2, memory=MEMORY) as cluster:
            wrapped, nets = [None, None], [make_model("batchnorm") for _ in range(2)]  # one seeded RNG

            def wrap(rank):  # both at once: the constructor waits for every worker
                wrapped[rank] = self.wrap(cluster, "bn2", flatshard.SGD(lr=0.1), rank=rank, workers=2,
                                          net=nets[rank])[1]

            in_parallel([lambda r=r: wrap(r) for r in range(2)])

            def train(rank):
                for _ in range(3):
                    F.mse_loss(wrapped[rank](x[rank * 8:(rank + 1) * 8]), y[rank * 8:(rank + 1) * 8]).backward()
                    wrapped[rank].step()

            in_parallel([lambda r=r: train(r) for r in range(2)])
            state = wrapped[0].state_dict()
            # Each worker holds its own buffers until the next forward; full_params() gives
            # the servers' (the mean), parameters and buffers alike.
            bn = wrapped[0].module.bn
            self.assertFalse(torch.equal(bn.running_var, state["bn.running_var"]))
            with wrapped[0].full_params():
                local = wrapped[0].module.state_dict()
                for name, value in state.items():
                    self.assertTrue(torch.equal(local[name], value), name)
            outputs = []
            for model in wrapped:  # each gathers the servers' buffers: one model again
                model.eval()
                with torch.no_grad():
                    outputs.append(model(x))
                self.assertTrue(torch.equal(model.module.bn.running_var, state["bn.running_var"]))
        self.assertTrue(torch.equal(outputs[0], outputs[1]))
        for name, value in two_workers_with_averaged_buffers(3, lr=0.1).state_dict().items():
            self.assertLess(relative_error(state[name], value), REL_TOL, name)
        self.assertTrue(torch.equal(state["bn.num_batches_tracked"], torch.tensor(3)))

    def test_full_params_gives_the_servers_buffers_of_any_dtype(self):
        # A float64 buffer that each worker's forwards move apart (the sum of its inputs):
        # held apart from the fp32 ones, so full_params() must unpack it.
        class Counted(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.linear = torch.nn.Linear(8, 4)
                self.register_buffer("seen", torch.zeros(1, dtype=torch.float64))

            def forward(self, x):
                self.seen += x.sum().double()
                return self.linear(x)

        x, y = make_data("mlp")
        with checked_cluster.LocalCluster(servers=2, memory=MEMORY) as cluster:
            wrapped = [None, None]

            def wrap(rank):
                torch.manual_seed(0)
                wrapped[rank] = self.wrap(cluster, "counted", flatshard.SGD(lr=0.1), rank=rank, workers=2,
                                          net=Counted())[1]

            in_parallel([lambda r=r: wrap(r) for r in range(2)])

            def train(rank):
                F.mse_loss(wrapped[rank](x[rank * 8:(rank + 1) * 8]), y[rank * 8:(rank + 1) * 8]).backward()
                wrapped[rank].step()

            in_parallel([lambda r=r: train(r) for r in range(2)])
            mean = (x[:8].sum().double() + x[8:].sum().double()) / 2
            self.assertNotAlmostEqual(wrapped[0].module.seen.item(), mean.item(), places=3)  # its own
            with wrapped[0].full_params():
                self.assertAlmostEqual(wrapped[0].module.seen.item(), mean.item(), places=4)
                self.assertEqual(wrapped[0].module.seen.dtype, torch.float64)

    def test_buffers_move_in_fp32_under_mixed_precision(self):
        # Gradients in bfloat16 (buffers sent apart from them, in fp32), then a model
        # whose parameters and buffers are bfloat16, BatchNorm's too (gathered in
        # bfloat16; buffers apart).
        x, y = make_data("batchnorm")
        for dtypes in ({"reduce_dtype": torch.bfloat16},
                       {"param_dtype": torch.bfloat16, "full_precision_modules": ()}):  # BatchNorm in bf16
            with self.subTest(**{k: str(v) for k, v in dtypes.items()}), \
                    checked_cluster.LocalCluster(servers=2, memory=MEMORY) as cluster:
                net = make_model("batchnorm")
                if "param_dtype" in dtypes:
                    net = net.to(torch.bfloat16)
                _, model = self.wrap(cluster, "bn", flatshard.SGD(lr=0.1), net=net, **dtypes)
                for _ in range(2):
                    F.mse_loss(model(x).float(), y).backward()
                    model.step()
                    state = model.state_dict()  # what the step sent
                    for name, value in model.module.state_dict().items():
                        if name.startswith("bn.running") or name == "bn.num_batches_tracked":
                            self.assertTrue(torch.equal(state[name], value), name)
                running_var = model.module.bn.running_var
                if running_var.dtype == torch.float32:  # not a bfloat16 value: it went in fp32
                    self.assertFalse(torch.equal(running_var.bfloat16().float(), running_var))
                self.assertTrue(torch.equal(state["bn.num_batches_tracked"], torch.tensor(2)))

    def test_a_buffer_the_module_replaces_is_sent_with_its_values(self):
        x, y = make_data("batchnorm")
        with checked_cluster.LocalCluster(servers=2, memory=MEMORY) as cluster:
            _, model = self.wrap(cluster, "bn", flatshard.SGD(lr=0.1))
            loss = F.mse_loss(model(x), y)
            model.module.bn.running_mean = torch.full((32,), 5.0)  # a new tensor, after the forward
            model.module.bn.num_batches_tracked = torch.tensor(7)
            loss.backward()
            model.step()
            state = model.state_dict()
            self.assertTrue(torch.equal(state["bn.running_mean"], torch.full((32,), 5.0)))
            self.assertTrue(torch.equal(state["bn.num_batches_tracked"], torch.tensor(7)))
            # Replaced between step() and the next forward: the servers' values win, as a
            # parameter's do.
            model.module.bn.running_mean = torch.full((32,), 9.0)
            model.eval()
            with torch.no_grad():
                model(x)
            self.assertTrue(torch.equal(model.module.bn.running_mean, torch.full((32,), 5.0)))
            model.train()
            F.mse_loss(model(x), y).backward()  # it updates the buffers the servers' values are in
            model.step()
            self.assertTrue(torch.equal(model.state_dict()["bn.num_batches_tracked"], torch.tensor(8)))

    def test_load_state_dict_pushes_the_buffers_to_the_servers(self):
        x, y = make_data("batchnorm")
        trained = make_model("batchnorm")
        optimizer = torch.optim.SGD(trained.parameters(), lr=0.1)
        for _ in range(3):
            optimizer.zero_grad()
            F.mse_loss(trained(x), y).backward()
            optimizer.step()
        with checked_cluster.LocalCluster(servers=2, memory=MEMORY) as cluster:
            _, model = self.wrap(cluster, "bn", flatshard.SGD(lr=0.1))
            model.load_state_dict(trained.state_dict())
            for name, value in trained.state_dict().items():  # read back from the servers
                self.assertTrue(torch.equal(model.state_dict()[name], value), name)
            model.eval()
            trained.eval()
            with torch.no_grad():
                self.assertTrue(torch.equal(model(x), trained(x)))  # its forward gathered them

    def test_a_module_under_two_paths_has_its_buffers_under_both(self):
        x, y = make_data("batchnorm")
        net = make_model("batchnorm")
        net.norm = net.bn  # one BatchNorm1d, registered twice: torch's state_dict lists both
        with checked_cluster.LocalCluster(servers=2, memory=MEMORY) as cluster:
            _, model = self.wrap(cluster, "bn", flatshard.SGD(lr=0.1), net=net)
            F.mse_loss(model(x), y).backward()
            model.step()
            state = model.state_dict()
            self.assertEqual(list(state), list(net.state_dict()))
            for name in ("weight", "running_mean", "num_batches_tracked"):
                self.assertTrue(torch.equal(state[f"norm.{name}"], state[f"bn.{name}"]), name)
            reference = make_model("batchnorm")
            reference.norm = reference.bn
            reference.load_state_dict(state, strict=True)
            # Pushed under the second path alone (torch's strict load would want both).
            given = {name: value for name, value in state.items() if not name.startswith("bn.")}
            given["norm.running_mean"] = torch.full((32,), 3.0)
            again = make_model("batchnorm")
            again.norm = again.bn
            _, fresh = self.wrap(cluster, "pushed", flatshard.SGD(lr=0.1), net=again)
            result = fresh.load_state_dict(given, strict=False)
            self.assertEqual(result.missing_keys, sorted(name for name in state if name.startswith("bn.")))
            pushed = fresh.state_dict()
            self.assertTrue(torch.equal(pushed["bn.running_mean"], torch.full((32,), 3.0)))
            self.assertTrue(torch.equal(pushed["bn.running_var"], state["bn.running_var"]))

    def test_checkpoints_and_exports_hold_the_buffers(self):
        x, y = make_data("batchnorm")
        with tempfile.TemporaryDirectory() as root, tempfile.TemporaryDirectory() as out, \
                checked_cluster.LocalCluster(servers=2, checkpoint_root=root, memory=MEMORY) as cluster:
            client, model = self.wrap(cluster, "bn", flatshard.SGD(lr=0.1))
            for _ in range(3):
                F.mse_loss(model(x), y).backward()
                model.step()
            saved = model.state_dict()
            for kind in ("full", "sharded"):
                client.save_checkpoint(kind, kind=kind)
            client.export_state_dict(out, kind="full")
            tensors, _ = read_safetensors(os.path.join(out, "model.safetensors"))
            exported = make_model("batchnorm")
            exported.load_state_dict(tensors, strict=True)  # buffers too; num_batches_tracked as F32
            for name, value in exported.state_dict().items():
                self.assertTrue(torch.equal(value, saved[name]), name)
            model.eval()
            exported.eval()
            with torch.no_grad():
                self.assertTrue(torch.equal(model(x), exported(x)))
            for kind in ("full", "sharded"):
                with self.subTest(kind=kind):
                    _, loaded = self.wrap(cluster, f"loaded-{kind}", flatshard.SGD(lr=0.1), load_checkpoint=kind)
                    self.assertEqual(loaded.version, 3)
                    for name, value in loaded.state_dict().items():
                        self.assertTrue(torch.equal(value, saved[name]), name)
                    loaded.eval()
                    with torch.no_grad():
                        self.assertTrue(torch.equal(loaded(x), exported(x)))  # its forward gathered them
                    self.assertTrue(torch.equal(loaded.module.bn.running_mean, saved["bn.running_mean"]))
            # A load while the module trains on: its next forward is voided, the one after
            # runs on the loaded buffers.
            model.train()
            for _ in range(2):
                F.mse_loss(model(x), y).backward()
                model.step()
            client.load_checkpoint("full")
            with self.assertRaises(flatshard.AbortedError):
                model(x)
            model.eval()
            with torch.no_grad():
                self.assertTrue(torch.equal(model(x), exported(x)))
            self.assertEqual(model.version, 3)
            self.assertTrue(torch.equal(model.module.bn.num_batches_tracked, saved["bn.num_batches_tracked"]))
            # A load of the version the step is at, between its forward (which changed the
            # buffers here) and step(): the step is voided, the buffers are the loaded ones.
            model.train()
            F.mse_loss(model(x), y).backward()
            client.load_checkpoint("full")
            with self.assertRaises(flatshard.AbortedError):
                model.step()
            model.eval()
            with torch.no_grad():
                self.assertTrue(torch.equal(model(x), exported(x)))


def torch_bf16_with_fp32_batchnorm(model, steps, lr):
    """Trains `model` (the BatchNorm net, fp32) with torch alone, as FSDP's
    MixedPrecision(param_dtype=torch.bfloat16) runs it on one worker: the Linear layers on
    bf16 copies of the fp32 parameters and a bf16 input, BatchNorm in fp32 (its parameters
    and buffers as they are) on its input cast up, its output cast back to bf16; SGD on the
    fp32 parameters with their gradients as they come (the Linear layers' bf16)."""
    x, y = make_data("batchnorm")
    for _ in range(steps):
        model.zero_grad()
        h = F.linear(x.bfloat16(), model.fc1.weight.bfloat16())
        h = model.bn(h.float()).bfloat16()
        out = F.linear(torch.tanh(h), model.fc2.weight.bfloat16(), model.fc2.bias.bfloat16())
        F.mse_loss(out.float(), y).backward()
        with torch.no_grad():
            for param in model.parameters():
                param -= lr * param.grad
    return model


class FullPrecisionModulesTest(unittest.TestCase):
    """BatchNorm kept in fp32 under a lower param_dtype, as FSDP's MixedPrecision keeps it
    (full_precision_modules)."""

    wrap = staticmethod(wrap_in_cluster)

    def test_batchnorm_trains_in_fp32_under_bf16_params(self):
        # The model as it comes (fp32), then converted to bf16 (BatchNorm's buffers too:
        # they become fp32 again).
        x, y = make_data("batchnorm")
        for converted in (False, True):
            with self.subTest(converted=converted), \
                    checked_cluster.LocalCluster(servers=2, memory=MEMORY) as cluster:
                net = make_model("batchnorm").to(torch.bfloat16 if converted else torch.float32)
                _, model = self.wrap(cluster, "bn", flatshard.SGD(lr=0.1), net=net, param_dtype=torch.bfloat16)
                self.assertEqual([name for name, _, _ in model.groups],
                                 ["model.<root>", "model.<root>.<full_precision>", "model.fc1"])
                for _ in range(3):
                    out = model(x)
                    F.mse_loss(out.float(), y).backward()
                    model.step()
                self.assertEqual(out.dtype, torch.bfloat16)  # BatchNorm's output cast back for fc2
                self.assertEqual([net.fc1.weight.dtype, net.fc2.weight.dtype, net.bn.weight.dtype,
                                  net.bn.bias.dtype, net.bn.running_var.dtype],
                                 [torch.bfloat16, torch.bfloat16, torch.float32, torch.float32, torch.float32])
                state = model.state_dict()
            reference = make_model("batchnorm")
            if converted:
                reference = reference.to(torch.bfloat16).float()
            torch_bf16_with_fp32_batchnorm(reference, 3, lr=0.1)
            for name, value in reference.state_dict().items():
                self.assertLess(relative_error(state[name], value), REL_TOL, name)
            # Not what BatchNorm in bf16 gives: its running variance is no bf16 value.
            self.assertFalse(torch.equal(state["bn.running_var"].bfloat16().float(), state["bn.running_var"]))
            self.assertTrue(torch.equal(state["bn.num_batches_tracked"], torch.tensor(3)))

    def test_frozen_batchnorm_is_gathered_in_fp32(self):
        # BatchNorm and fc1 frozen: two frozen groups, BatchNorm's gathered in fp32.
        x, y = make_data("batchnorm")
        net = make_model("batchnorm")
        with torch.no_grad():
            net.bn.weight.uniform_(0.5, 1.5)  # values bf16 would round
            net.bn.bias.uniform_(-0.5, 0.5)
        original = {name: value.clone() for name, value in net.state_dict().items()}
        for param in list(net.fc1.parameters()) + list(net.bn.parameters()):
            param.requires_grad_(False)
        with checked_cluster.LocalCluster(servers=2, memory=MEMORY) as cluster:
            _, model = self.wrap(cluster, "frozen", flatshard.SGD(lr=0.1), net=net, param_dtype=torch.bfloat16)
            self.assertEqual(model.groups, [("model.<root>", "", ["fc2.weight", "fc2.bias"]),
                                            ("model.<frozen>", None, ["fc1.weight"]),
                                            ("model.<frozen>.<full_precision>", None, ["bn.weight", "bn.bias"])])
            for _ in range(2):
                F.mse_loss(model(x).float(), y).backward()
                model.step()
            self.assertEqual(net.bn.weight.dtype, torch.float32)
            self.assertTrue(torch.equal(net.fc1.weight, original["fc1.weight"].bfloat16()))
            state = model.state_dict()
        for name in ("fc1.weight", "bn.weight", "bn.bias"):  # frozen: the fp32 values wrapped
            self.assertTrue(torch.equal(state[name], original[name]), name)
        self.assertFalse(torch.equal(state["fc2.weight"], original["fc2.weight"]))  # trained
        self.assertTrue(torch.equal(net.bn.weight, state["bn.weight"]))  # gathered in fp32
        self.assertTrue(torch.equal(net.bn.bias, state["bn.bias"]))

    def test_a_full_precision_module_runs_on_fp32_inputs_and_gives_back_bf16(self):
        class Probe(torch.nn.Module):  # a module of the user's, kept in fp32
            def __init__(self):
                super().__init__()
                self.scale = torch.nn.Parameter(torch.linspace(0.5, 1.5, 16))
                self.seen = []

            def forward(self, x, pair):
                self.seen.append((x.dtype, pair[1].dtype, self.scale.dtype))
                return x * self.scale, {"sum": x.sum(dim=1)}

        class Net(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.fc1 = torch.nn.Linear(8, 16)
                self.probe = Probe()
                self.fc2 = torch.nn.Linear(16, 4)

            def forward(self, x):
                h = self.fc1(x)
                h, extra = self.probe(h, (1, h))
                return self.fc2(h), extra["sum"]

        x, y = make_data("mlp")
        with checked_cluster.LocalCluster(servers=2, memory=MEMORY) as cluster:
            for classes in ((Probe,), ()):
                with self.subTest(classes=classes):
                    _, model = self.wrap(cluster, f"probe{len(classes)}", flatshard.SGD(lr=0.1), net=Net(),
                                         param_dtype=torch.bfloat16, full_precision_modules=classes)
                    out, total = model(x)
                    F.mse_loss(out.float(), y).backward()
                    model.step()
                    inside = torch.float32 if classes else torch.bfloat16
                    self.assertEqual(model.module.probe.seen, [(inside, inside, inside)])
                    self.assertEqual((out.dtype, total.dtype), (torch.bfloat16, torch.bfloat16))

    def test_full_precision_modules_must_be_module_classes(self):
        with checked_cluster.LocalCluster(servers=1, memory=MEMORY) as cluster:
            with self.assertRaisesRegex(flatshard.InvalidArgumentError, "full_precision_modules: expected"):
                self.wrap(cluster, "bad", flatshard.SGD(lr=0.1), param_dtype=torch.bfloat16,
                          full_precision_modules=("BatchNorm1d",))


class ScriptedNorms:
    """Stands in for a ShardedModule: step() does nothing, grad_norm() replays `norms`."""

    def __init__(self, norms):
        self._norms = list(norms)
        self._grad_scale = 1.0

    def step(self):
        pass

    def grad_norm(self):
        return self._norms.pop(0)


def held(layers):
    """The indices of `layers` whose parameters hold memory (reshard_after_forward leaves a
    freed module's parameters empty). A look at their metadata, which a watched forward's
    GatherOnUse does not take for a use."""
    return [i for i, layer in enumerate(layers) if layer.weight.numel() > 0]


def plain_and_resharded(cluster, kind):
    """Model `kind` wrapped twice in one-worker jobs on `cluster` (one_worker_mlp_on): by
    default, and with reshard_after_forward."""
    _, plain = one_worker_mlp_on(cluster, "plain", kind=kind)
    _, model = one_worker_mlp_on(cluster, "resharded", kind=kind, reshard_after_forward=True)
    return plain, model


class WatchedForwardTest(unittest.TestCase):
    """The forwards before the first step run under GatherOnUse, which finds the groups
    whose parameters are used outside their module's forward; from then on their gathers
    are waited for before the forward begins. (With reshard_after_forward:
    ReshardAfterForwardTest.)"""

    def test_a_weight_used_before_its_module_is_waited_for_up_front(self):
        # Layer 1's weight is used before layer 1's forward, whose pre-hook would wait for
        # its gather; layer 0's after its forward, which has waited.
        x, y = make_data("reused")
        with checked_cluster.LocalCluster(servers=2, memory=MEMORY) as cluster:
            _, model = one_worker_mlp_on(cluster, "watched", kind="reused")
            layer1 = next(group for group in model._used if group.path == "layers.1")
            in_flight = []  # at the embedding's forward: whether layer 1's gather is in flight
            model.module.embed.register_forward_pre_hook(
                lambda _m, _in: in_flight.append(layer1.pending_gather is not None))
            for _ in range(3):
                F.mse_loss(model(x), y).backward()
                model.step()
            self.assertEqual([group.path for group in model._used if group.functional], ["layers.1"])
            self.assertEqual(in_flight, [True, False, False])
            self.assertFalse(model._watching)


class ReshardAfterForwardTest(MatchesSgd, unittest.TestCase):
    """reshard_after_forward=True (FSDP's FULL_SHARD): what a worker holds when, and that
    failures and loads met in backward leave the module as they do without it. Parity
    with torch: ParityTest.test_reshard_after_forward_*."""

    def train(self, model, x, y, steps, record=None):
        """`steps` SGD steps on (x, y), the second with a micro-batch accumulated under
        no_sync() first; returns the losses."""
        losses = []
        for step in range(steps):
            if step == 1:
                with model.no_sync():
                    F.mse_loss(model(x[:4]), y[:4]).backward()
            loss = F.mse_loss(model(x), y)
            loss.backward()
            if record is not None:
                record(model)
            model.step()
            losses.append(loss.item())
        return losses

    def test_each_layer_is_held_around_its_forward_and_backward_alone(self):
        import flatshard.torch
        x, y = make_data("chain")
        layer_bytes = 4 * (192 * 192 + 192)
        # The prefetch budget: the next group's parameters alone, or those of the next two
        # layers (and the small head or embedding beside them).
        for budget, ahead in ((0, 1), (2 * layer_bytes + 8192, 2)):
            with self.subTest(ahead=ahead), mock.patch.object(flatshard._torch_reshard, "PREFETCH_BYTES", budget), \
                    checked_cluster.LocalCluster(servers=2, memory=MEMORY) as cluster:
                self.check_held(cluster, x, y, ahead)

    def check_held(self, cluster, x, y, ahead):
        _, plain = one_worker_mlp_on(cluster, "plain", kind="chain")
        plain_losses = self.train(plain, x, y, 3)
        _, model = one_worker_mlp_on(cluster, "resharded", kind="chain", reshard_after_forward=True)
        layers = list(model.module.layers)
        forwards, backwards = [], []  # (layer, the layers held then)
        for i, layer in enumerate(layers):  # hooks after the module's own: it has gathered
            layer.register_forward_pre_hook(lambda _m, _in, i=i: forwards.append((i, held(layers))))

            def on_output(_m, _in, output, i=i):
                if output.requires_grad:
                    output.register_hook(lambda _g, i=i: backwards.append((i, held(layers))))

            layer.register_forward_hook(on_output)

        def after_backward(model):
            self.assertEqual(held(layers), [])
            for layer in layers:
                self.assertEqual(layer.weight.numel(), 0)  # a use outside its forward fails on its shape
                self.assertIsNone(layer.weight.grad)  # the flat gradient holds it, not the parameter
            self.assertEqual(model.module.scale.numel(), 192)  # the root's stay

        losses = self.train(model, x, y, 3, record=after_backward)
        self.assertEqual(losses, plain_losses)
        ours, theirs = model.state_dict(), plain.state_dict()
        for name, value in theirs.items():
            self.assertTrue(torch.equal(ours[name], value), name)
        self.assertEqual(held(layers), [])
        resharded = [group for group in model._groups if group.reshards]
        self.assertEqual(len(resharded), 6)  # embed, the layers and the head; not the root
        self.assertFalse(any(group.grad_resident for group in resharded))  # freed once sent
        # From the first step on (which prefetches in the modules' order: the forward's
        # here), a layer's forward holds itself and the layers `ahead` (prefetched),
        # backward itself and those before.
        self.assertEqual([i for i, _ in forwards], list(range(len(layers))) * 4)
        for i, holding in forwards:
            self.assertEqual(holding, list(range(i, min(i + ahead + 1, len(layers)))), forwards)
        self.assertEqual([i for i, _ in backwards], list(reversed(range(len(layers)))) * 4)
        for i, holding in backwards:
            self.assertEqual(holding, list(range(max(i - ahead, 0), i + 1)), backwards)
        with torch.no_grad():  # an evaluation frees them as it goes, and what it gathered ahead
            self.assertTrue(torch.equal(model(x), plain(x)))
        self.assertEqual(held(layers), [])

    def test_weights_used_outside_their_modules_are_found_in_the_first_step_and_held(self):
        # Layer 1's weight is used before its forward, layer 0's after: the first step's
        # watched forward gathers them there, and from then on they are gathered up front
        # and held through the step, while layer 2 comes and goes around its own forward.
        x, y = make_data("reused")
        with mock.patch.object(flatshard._torch_reshard, "PREFETCH_BYTES", 0), \
                checked_cluster.LocalCluster(servers=2, memory=MEMORY) as cluster:
            plain, model = plain_and_resharded(cluster, "reused")
            layers = list(model.module.layers)
            during = []  # the layers held at each layer's forward
            for i, layer in enumerate(layers):
                layer.register_forward_pre_hook(lambda _m, _in, i=i: during.append((i, held(layers))))
            after = []
            self.assertEqual(self.train(model, x, y, 3, record=lambda _: after.append(held(layers))),
                             self.train(plain, x, y, 3))
            ours, theirs = model.state_dict(), plain.state_dict()
            for name, value in theirs.items():
                self.assertTrue(torch.equal(ours[name], value), name)
            # The first forward: layer 1 was gathered for its early use and stays, layer 0
            # is freed after its forward (its later use gathers it again), and the next layer
            # is prefetched at each layer's turn.
            self.assertEqual(during[:3], [(0, [0, 1]), (1, [1, 2]), (2, [1, 2])])
            for i, holding in during[3:]:  # later forwards: 0 and 1 up front
                self.assertEqual(holding, [0, 1, 2] if i > 0 else [0, 1], during)
            self.assertEqual(after, [[], [], []])  # freed once their gradients are in
            functional = [group.path for group in model._used if group.functional]
            self.assertEqual(functional, ["layers.0", "layers.1"])
            with torch.no_grad():
                self.assertTrue(torch.equal(model(x), plain(x)))
            self.assertEqual(held(layers), [])

    def test_a_layer_left_out_of_a_forward_is_freed_by_the_end_of_backward(self):
        # Layer 1's forward prefetches layer 2, as in the forward before; layer 2 is skipped
        # (a layer drop), gets no gradient, and is freed when backward ends.
        x, y = make_data("chain")
        with checked_cluster.LocalCluster(servers=2, memory=MEMORY) as cluster:
            plain, model = plain_and_resharded(cluster, "chain")
            layers = list(model.module.layers)
            for net in (plain, model):
                self.train(net, x, y, 1)
                net.module.skip = {2}
            during = []
            layers[3].register_forward_pre_hook(lambda _m, _in: during.append(held(layers)))
            self.assertEqual(self.train(model, x, y, 1, record=lambda _: during.append(held(layers))),
                             self.train(plain, x, y, 1))
            self.assertEqual(during, [[2, 3], []])
            with torch.no_grad():  # an evaluation frees what it gathered ahead in vain too
                model(x)
            self.assertEqual(during[-1], [2, 3])
            self.assertEqual(held(layers), [])
            ours, theirs = model.state_dict(), plain.state_dict()
            for name, value in theirs.items():
                self.assertTrue(torch.equal(ours[name], value), name)

    def test_a_state_dict_loaded_non_strictly_leaves_the_rest_at_the_servers_values(self):
        # Resharded, the module's tensors hold nothing from the wrapping on: what a key left
        # out keeps is the servers' value.
        x, y = make_data("chain")
        with checked_cluster.LocalCluster(servers=2, memory=MEMORY) as cluster:
            for reshard in (False, True):
                with self.subTest(reshard_after_forward=reshard):
                    _, model = one_worker_mlp_on(cluster, f"partial-{reshard}", kind="chain",
                                                 reshard_after_forward=reshard)
                    before = model.state_dict()
                    result = model.load_state_dict({"layers.0.weight": torch.zeros(192, 192)}, strict=False)
                    self.assertEqual(result.missing_keys, sorted(set(before) - {"layers.0.weight"}))
                    after = model.state_dict()
                    self.assertTrue(torch.equal(after["layers.0.weight"], torch.zeros(192, 192)))
                    for name, value in before.items():
                        if name != "layers.0.weight":
                            self.assertTrue(torch.equal(after[name], value), name)
                    F.mse_loss(model(x), y).backward()  # trains on from the values loaded
                    model.step()
                    self.assertEqual(model.version, 1)

    def test_full_params_holds_the_servers_values_for_a_block(self):
        x, y = make_data("chain")
        with checked_cluster.LocalCluster(servers=2, memory=MEMORY) as cluster:
            for reshard in (False, True):
                with self.subTest(reshard_after_forward=reshard):
                    _, model = one_worker_mlp_on(cluster, f"full-{reshard}", kind="chain",
                                                 reshard_after_forward=reshard)
                    for _ in range(2):  # as train_reference trains
                        F.mse_loss(model(x), y).backward()
                        model.step()
                    layers = list(model.module.layers)
                    # Without it, the module holds what its last forward gathered: the values
                    # before the last step; with it, nothing.
                    last = [layer.weight.detach().clone() for layer in layers]
                    servers = model.state_dict()
                    with model.full_params() as same:
                        self.assertIs(same, model)
                        local = model.module.state_dict()
                        self.assertEqual(set(local), set(servers))
                        for name, value in servers.items():
                            self.assertTrue(torch.equal(local[name], value), name)
                    if reshard:
                        self.assertEqual(held(layers), [])
                    else:
                        self.assertFalse(torch.equal(last[0], layers[0].weight))
                    F.mse_loss(model(x), y).backward()  # and training goes on
                    model.step()
                    state = model.state_dict()
                    self.assert_matches_sgd(state, steps=3, kind="chain")

    def test_frozen_layers_under_adapters_are_held_around_their_forward_and_backward(self):
        # LoRA fine-tuning: each layer's frozen base is a group of its own, freed after its
        # forward and, in backward, once backward has gone through it (no gradient says so).
        import flatshard.torch
        x, y = make_data("lora")
        with mock.patch.object(flatshard._torch_reshard, "PREFETCH_BYTES", 0), \
                checked_cluster.LocalCluster(servers=2, memory=MEMORY) as cluster:
            plain, model = plain_and_resharded(cluster, "lora")
            names = [name for name, _, _ in model.groups]
            self.assertIn("model.layers.0.base.<frozen>", names)
            self.assertIn("model.layers.0", names)  # its adapters
            self.assertNotIn("model.layers.0.base.<frozen>", [name for name, _, _ in plain.groups])
            bases = [layer.base for layer in model.module.layers]
            forwards, backwards = [], []
            for i, layer in enumerate(model.module.layers):
                bases[i].register_forward_pre_hook(lambda _m, _in, i=i: forwards.append((i, held(bases))))

                def on_output(_m, _in, output, i=i):
                    if output.requires_grad:
                        output.register_hook(lambda _g, i=i: backwards.append((i, held(bases))))

                layer.register_forward_hook(on_output)
            self.assertEqual(self.train(model, x, y, 3, record=lambda _: self.assertEqual(held(bases), [])),
                             self.train(plain, x, y, 3))
            ours, theirs = model.state_dict(), plain.state_dict()
            for name, value in theirs.items():
                self.assertTrue(torch.equal(ours[name], value), name)
            initial = make_model("lora").state_dict()
            self.assertTrue(torch.equal(ours["layers.0.base.weight"], initial["layers.0.base.weight"]))
            self.assertFalse(torch.equal(ours["layers.0.down.weight"], initial["layers.0.down.weight"]))
            later = len(bases)  # the first forward gathers everything up front
            self.assertEqual(forwards[later:], [(i, [i]) for i in range(len(bases))] * 3)
            self.assertEqual(backwards[len(bases):], [(i, [i]) for i in reversed(range(len(bases)))] * 3)
            with model.full_params():
                self.assertEqual(held(bases), list(range(len(bases))))
            self.assertEqual(held(bases), [])
            # Values pushed (before the first step) while held: the next forward gathers
            # them, frozen ones too.
            _, model = one_worker_mlp_on(cluster, "pushed", kind="lora", reshard_after_forward=True)
            fresh = make_model("lora")
            with torch.no_grad():
                for p in fresh.parameters():
                    p.mul_(0.5)
            with model.full_params(), torch.no_grad():
                model.load_state_dict(fresh.state_dict())
                self.assertTrue(torch.equal(model(x), fresh(x)))

    def test_bfloat16_parameters_and_gradients_reshard_too(self):
        # Host flat buffers of bfloat16 go to the client as int16 arrays over their address.
        x, y = make_data("lora")
        with checked_cluster.LocalCluster(servers=2, memory=MEMORY) as cluster:
            runs = []
            for reshard in (False, True):
                _, model = one_worker_mlp_on(cluster, f"bf16-{reshard}", kind="lora", param_dtype=torch.bfloat16,
                                             reshard_after_forward=reshard)
                losses = []
                for _ in range(3):
                    loss = F.mse_loss(model(x).float(), y)
                    loss.backward()
                    model.step()
                    losses.append(loss.item())
                runs.append((losses, model.state_dict()))
            (plain_losses, plain_state), (losses, state) = runs
            self.assertEqual(losses, plain_losses)
            self.assertLess(losses[-1], losses[0])
            for name, value in plain_state.items():
                self.assertTrue(torch.equal(state[name], value), name)
            self.assertEqual(held([layer.base for layer in model.module.layers]), [])

    def test_a_shared_parameter_stays_with_its_group(self):
        # The tied embedding's group holds it for unembed, whose forward uses it later; the
        # MLP's groups are freed.
        def net():
            torch.manual_seed(0)
            return models.TiedFrozenModel(dim=32)

        x, y = make_data("tied_frozen")
        with checked_cluster.LocalCluster(servers=2, memory=MEMORY) as cluster:
            _, plain = wrap_in_cluster(cluster, "plain", flatshard.SGD(lr=0.1), net=net())
            _, model = wrap_in_cluster(cluster, "resharded", flatshard.SGD(lr=0.1), net=net(),
                                       reshard_after_forward=True)
            self.assertEqual(self.train(model, x, y, 3), self.train(plain, x, y, 3))
            self.assertIn("model.embed", [name for name, _, _ in model.groups])
            self.assertEqual(model.module.embed.weight.numel(), 12 * 32)
            self.assertEqual(held(list(model.module.mlp)[::2]), [])

    def test_a_scatter_that_failed_in_backward_is_raised_by_step_and_sent_again(self):
        with one_worker_mlp("resend", kind="chain", reshard_after_forward=True) as (client, model):
            x, y = make_data("chain")
            victim = "model.layers.2"  # sent from backward (145 KiB), found failed there
            sent = fail_first_scatter(client, victim, arrives=False,
                                      error=flatshard.DeadlineExceededError("injected: the transfer timed out"))
            F.mse_loss(model(x), y).backward()
            self.assertIn(victim, sent)  # before step()
            with self.assertRaises(flatshard.DeadlineExceededError):
                model.step()
            self.assertEqual(model.version, 0)
            first = len(sent)
            model.step()  # the retry sends the gradient it kept
            self.assertEqual(sent[first:], [victim])
            self.assertEqual(model.version, 1)
            F.mse_loss(model(x), y).backward()
            model.step()
            state = model.state_dict()
        self.assert_matches_sgd(state, steps=2, kind="chain")

    def test_a_load_met_in_backward_voids_the_step_there(self):
        import flatshard.torch
        # Each group gathers the next alone (no prefetch budget), so that gathers follow the load.
        with mock.patch.object(flatshard._torch_reshard, "PREFETCH_BYTES", 0), tempfile.TemporaryDirectory() as root, \
                checked_cluster.LocalCluster(servers=2, checkpoint_root=root, memory=MEMORY) as cluster:
            client, model = one_worker_mlp_on(cluster, "reload", kind="chain", reshard_after_forward=True)
            client.save_checkpoint("start", kind="sharded")  # version 0
            x, y = make_data("chain")
            for _ in range(2):
                F.mse_loss(model(x), y).backward()
                model.step()
            # The operator's load comes once backward has sent the last layers' gradients
            # (145 KiB each: at once) and gathered layer 2 again: a later gather finds it.
            loaded = []

            def load_once(_grad):
                if not loaded:
                    loaded.append(client.load_checkpoint("start"))

            def on_output(_m, _in, output):
                output.register_hook(load_once)

            model.module.layers[2].register_forward_hook(on_output)
            loss = F.mse_loss(model(x), y)
            with self.assertRaises(flatshard.AbortedError) as aborted:
                loss.backward()
            self.assertEqual(len(loaded), 1)
            self.assertIn("the servers are at version 0 during step 2", aborted.exception.message)
            self.assertEqual(model.version, 0)
            with self.assertRaises(flatshard.FailedPreconditionError):
                model.step()
            loaded.append("no more")
            F.mse_loss(model(x), y).backward()  # training goes on from the loaded version
            model.step()
            self.assertEqual(model.version, 1)
            state = model.state_dict()
        self.assert_matches_sgd(state, steps=1, kind="chain")

    def test_reshard_after_forward_must_be_a_bool(self):
        with one_worker_mlp("refused") as (client, _):
            import flatshard.torch
            with self.assertRaises(flatshard.InvalidArgumentError) as refused:
                flatshard.torch.ShardedModule(make_model("mlp"), client, flatshard.SGD(lr=0.1),
                                              reshard_after_forward="yes")
            self.assertIn("reshard_after_forward: expected True or False", refused.exception.message)


class GradScalerPolicyTest(unittest.TestCase):
    def test_backs_off_on_a_non_finite_norm_and_grows_after_an_interval(self):
        model = ScriptedNorms([1.0, 1.0, float("inf"), 1.0, 1.0, 1.0, float("nan"), 1.0])
        scaler = flatshard.torch.GradScaler(model, init_scale=8.0, growth_factor=2.0,
                                            backoff_factor=0.25, growth_interval=3)
        self.assertEqual(scaler.scale(torch.tensor(1.5)).item(), 12.0)
        self.assertEqual(model._grad_scale, 8.0)  # the model unscales by it
        scales = []
        for _ in range(8):
            scaler.step()
            scales.append(scaler.get_scale())
        # 2 good steps, inf: / 4; 3 good: x 2; NaN: / 4; 1 good.
        self.assertEqual(scales, [8, 8, 2, 2, 2, 4, 1, 1])
        saved = scaler.state_dict()
        restored = flatshard.torch.GradScaler(ScriptedNorms([1.0, 1.0]), growth_interval=3)
        restored.load_state_dict(saved)
        self.assertEqual(restored.get_scale(), 1.0)
        restored.step()
        restored.step()  # with the one good step before the save: 3 in a row
        self.assertEqual(restored.get_scale(), 2.0)

    def test_refuses_settings_that_would_not_converge(self):
        for bad in ({"init_scale": 0}, {"growth_factor": 1.0}, {"backoff_factor": 1.0},
                    {"growth_interval": 0}):
            with self.assertRaises(flatshard.InvalidArgumentError, msg=str(bad)):
                flatshard.torch.GradScaler(ScriptedNorms([]), **bad)


# Optimizers whose state every kind of it exercises (Adam's moments, its amsgrad maximum
# and step count; SGD's momentum buffers): ours and torch's of the same settings.
OPTIMIZERS_WITH_STATE = [
    (flatshard.AdamW(lr=1e-2, weight_decay=0.05, amsgrad=True),
     lambda groups: torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.05, amsgrad=True)),
    (flatshard.SGD(lr=0.05, momentum=0.9, weight_decay=1e-3),
     lambda groups: torch.optim.SGD(groups, lr=0.05, momentum=0.9, weight_decay=1e-3))]


class OptimStateDictTest(unittest.TestCase):
    def test_the_servers_optimizer_state_in_torchs_form_matches_torchs(self):
        # One worker on the whole batch against torch's optimizer with the same param
        # groups: step counts, settings, and every state tensor within 1e-4 relative (the
        # parameters agree to 1e-5 after each step, so the gradients the state sums do to
        # about as much, and the squares in Adam's second moments to twice that).
        x, y = make_data("mlp")
        no_decay = [name for name, p in make_model("mlp").named_parameters() if p.ndim < 2]
        for ours, make_theirs in OPTIMIZERS_WITH_STATE:
            with self.subTest(optimizer=type(ours).__name__), \
                    checked_cluster.LocalCluster(servers=2, memory=MEMORY) as cluster:
                client = flatshard.Client(cluster.addresses, token=cluster.token, job="optim")
                client.configure_job()
                model = flatshard.torch.ShardedModule(make_model("mlp"), client, ours, auto_wrap_min_params=200,
                                                      param_groups=[{"params": no_decay, "weight_decay": 0.0}])
                self.assertEqual(set(map(len, model.optim_state_dict()["state"].values())), {0})  # no step yet
                reference = make_model("mlp")
                named = dict(reference.named_parameters())
                theirs = make_theirs([{"params": [p for n, p in named.items() if n not in no_decay]},
                                      {"params": [named[n] for n in no_decay], "weight_decay": 0.0}])
                train_side_by_side(model, reference, theirs, x, y, steps=3)
                got = model.optim_state_dict()
                for name, param in named.items():
                    expected = theirs.state[param]
                    self.assertEqual(set(got["state"][name]), set(expected), name)
                    for key, value in expected.items():
                        if key == "step":
                            self.assertEqual(float(got["state"][name][key]), float(value), name)
                            continue
                        self.assertEqual(got["state"][name][key].shape, value.shape, f"{name}.{key}")
                        self.assertLess(relative_error(got["state"][name][key], value), 10 * REL_TOL,
                                        f"{name}.{key}")
                self.assertEqual([sorted(g["params"]) for g in got["param_groups"]],
                                 [sorted(n for n in named if n not in no_decay), sorted(no_decay)])
                self.assertEqual([g["weight_decay"] for g in got["param_groups"]], [ours.weight_decay, 0.0])
                model.set_hyperparams(lr=1e-3)
                self.assertEqual([g["lr"] for g in model.optim_state_dict()["param_groups"]], [1e-3, 1e-3])

    def test_a_torch_run_resumes_on_flatshard_with_its_optimizer_state(self):
        # Three steps of torch alone, then its model and optimizer state dicts (named) into
        # a ShardedModule and its ServerOptimizer: two more steps agree with torch's own
        # next two (Adam's moments and step count restored: afresh, its first step would
        # move every parameter by about lr); the state reads back as given, bitwise.
        import flatshard.torch
        x, y = make_data("mlp")
        no_decay = [name for name, p in make_model("mlp").named_parameters() if p.ndim < 2]
        for ours, make_theirs in OPTIMIZERS_WITH_STATE:
            with self.subTest(optimizer=type(ours).__name__), \
                    checked_cluster.LocalCluster(servers=2, memory=MEMORY,
                                                 checkpoint_root=self.enterContext(tempfile.TemporaryDirectory())) \
                    as cluster:
                reference = make_model("mlp")
                named = dict(reference.named_parameters())
                theirs = make_theirs([{"params": [p for n, p in named.items() if n not in no_decay]},
                                      {"params": [named[n] for n in no_decay], "weight_decay": 0.0, "lr": 2e-2}])
                for _ in range(3):
                    theirs.zero_grad()
                    F.mse_loss(reference(x), y).backward()
                    theirs.step()
                saved = {"model": reference.state_dict(),
                         "optim": flatshard.torch.named_optim_state_dict(reference, theirs)}
                client = flatshard.Client(cluster.addresses, token=cluster.token, job="resume")
                client.configure_job()
                model = flatshard.torch.ShardedModule(make_model("mlp"), client, ours, auto_wrap_min_params=200,
                                                      param_groups=[{"params": no_decay, "weight_decay": 0.0}])
                optimizer = flatshard.torch.ServerOptimizer(model)
                model.load_state_dict(saved["model"])
                optimizer.load_state_dict(saved["optim"])
                self.assertEqual([g["lr"] for g in optimizer.param_groups], [ours.lr, 2e-2])  # torch's, restored
                self.assertEqual([c["name"] for c in client.list_checkpoints()], [])  # the import's, deleted
                got = optimizer.state_dict()
                for name, param in named.items():
                    for key, value in theirs.state[param].items():
                        if key == "step":
                            self.assertEqual(float(got["state"][name][key]), float(value), name)
                        else:
                            self.assertTrue(torch.equal(got["state"][name][key], value), f"{name}.{key}")
                train_side_by_side(model, reference, theirs, x, y, steps=2)
                state = model.state_dict()
                for name, param in named.items():
                    self.assertLess(relative_error(state[name], param.detach()), REL_TOL, name)

    def test_optimizer_state_that_does_not_fit_is_refused_and_changes_nothing(self):
        import flatshard.torch
        with checked_cluster.LocalCluster(servers=2, memory=MEMORY,
                                          checkpoint_root=self.enterContext(tempfile.TemporaryDirectory())) as cluster:
            client = flatshard.Client(cluster.addresses, token=cluster.token, job="misfit")
            client.configure_job()
            model = flatshard.torch.ShardedModule(make_model("mlp"), client, flatshard.Adam(lr=1e-2),
                                                  auto_wrap_min_params=200)
            x, y = make_data("mlp")
            F.mse_loss(model(x), y).backward()
            model.step()
            before = model.optim_state_dict()
            good = before["state"]["0.weight"]
            bias_state = {k: v for k, v in before["state"]["0.bias"].items()}
            for state, message in [
                    ({"nonsense": {}}, "optimizer state for ['nonsense'], which are not trained parameters"),
                    ({"0.weight": good}, "'0.weight' has optimizer state and '0.bias' has none"),
                    ({"0.weight": dict(good, exp_avg=torch.zeros(3)), "0.bias": bias_state},
                     "optimizer state 'exp_avg' of '0.weight' has shape [3], the parameter [32, 8]"),
                    ({"0.weight": dict(good, momentum_buffer=good["exp_avg"]), "0.bias": bias_state},
                     "optimizer state ['momentum_buffer'] of '0.weight'"),
                    ({"0.weight": dict(good, step=torch.tensor(7.0)), "0.bias": bias_state},
                     "share one Adam step count; the state gives [1, 7]")]:
                with self.subTest(message=message):
                    with self.assertRaises(flatshard.InvalidArgumentError) as refused:
                        model.load_optim_state_dict({"state": state})
                    self.assertIn(message, str(refused.exception))
            after = model.optim_state_dict()
            for name, saved in before["state"].items():
                for key, value in saved.items():
                    self.assertTrue(torch.equal(after["state"][name][key], value), f"{name}.{key}")
            # A state dict without state starts the optimizer afresh; training goes on.
            model.load_optim_state_dict({"state": {}})
            self.assertEqual(set(map(len, model.optim_state_dict()["state"].values())), {0})
            F.mse_loss(model(x), y).backward()
            model.step()
            self.assertEqual(model.version, 2)
            # Inside a step (the bucket of small groups' gradients not sent yet), it is a
            # load like any other: the step is void, its gradients dropped, and the next
            # forward trains on from the loaded version (2, the cut's).
            F.mse_loss(model(x), y).backward()
            model.load_optim_state_dict(model.optim_state_dict())
            with self.assertRaisesRegex(flatshard.FailedPreconditionError, "a checkpoint load voided the last step"):
                model.step()
            F.mse_loss(model(x), y).backward()
            model.step()
            self.assertEqual(model.version, 3)


class SchedulerWithGradScalerTest(unittest.TestCase):
    def test_a_scaler_steps_through_the_server_optimizer_that_a_scheduler_follows(self):
        with checked_cluster.LocalCluster(servers=2, memory=MEMORY) as cluster:
            client = flatshard.Client(cluster.addresses, token=cluster.token, job="scaled")
            client.configure_job(skip_nonfinite=True)
            model = flatshard.torch.ShardedModule(make_model("mlp"), client, flatshard.SGD(lr=0.1),
                                                  auto_wrap_min_params=200)
            optimizer = flatshard.torch.ServerOptimizer(model)
            scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
            scaler = flatshard.torch.GradScaler(model, init_scale=4.0)
            x, y = make_data("mlp")
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # torch warns of a scheduler stepped before its optimizer
                for _ in range(2):
                    scaler.scale(F.mse_loss(model(x), y)).backward()
                    self.assertTrue(math.isfinite(scaler.step(optimizer)))
                    scheduler.step()
            self.assertEqual(model.version, 2)
            self.assertEqual(optimizer.param_groups[0]["lr"], 0.025)
            with self.assertRaises(flatshard.InvalidArgumentError) as refused:
                scaler.step(torch.optim.SGD(make_model("mlp").parameters(), lr=0.1))
            self.assertIn("takes the ServerOptimizer of the scaler's model, not a SGD", str(refused.exception))


class ServerOptimizerCallsTest(unittest.TestCase):
    def test_param_groups_given_the_same_change_share_one_call(self):
        with checked_cluster.LocalCluster(servers=2, memory=MEMORY) as cluster:
            client = flatshard.Client(cluster.addresses, token=cluster.token, job="calls")
            client.configure_job()
            net = make_model("mlp")
            model = flatshard.torch.ShardedModule(net, client, flatshard.AdamW(lr=1e-2), auto_wrap_min_params=200,
                                                  param_groups=[{"params": [p for p in net.parameters() if p.ndim < 2],
                                                                 "weight_decay": 0.0}])
            optimizer = flatshard.torch.ServerOptimizer(model)
            calls, real = [], client.set_hyperparams_of
            client.set_hyperparams_of = lambda names, **changes: (calls.append((sorted(names), changes)),
                                                                  real(names, **changes))
            scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5 ** step)
            x, y = make_data("mlp")
            for step in range(2):
                F.mse_loss(model(x), y).backward()
                optimizer.step()
                scheduler.step()
            model(x)
            trained = sorted(name for name, path, _ in model.groups if path is not None)
            self.assertEqual(len(trained), 6)  # 3 wrapped modules, each with its biases apart
            # Both param groups' lr halves each step: one call for all six groups.
            self.assertEqual(calls, [(trained, {"lr": 5e-3}), (trained, {"lr": 2.5e-3})])
            optimizer.param_groups[1]["lr"] = 1e-4  # the biases' alone
            model(x)
            self.assertEqual(calls[-1], ([n for n in trained if n.endswith(".<param_groups[0]>")], {"lr": 1e-4}))


class MixedPrecisionAndExportTest(unittest.TestCase):
    def test_bf16_params_fp32_reduce_converges_and_gathers_exact_casts(self):
        with checked_cluster.LocalCluster(servers=3, memory=MEMORY) as cluster:
            losses, _, groups, _, _ = train_flatshard(cluster, "mlp", flatshard.Adam(lr=1e-2), 30,
                                                      param_dtype=torch.bfloat16)
            self.assertLess(losses[-1], 0.5 * losses[0], losses)
            client = flatshard.Client(cluster.addresses, worker_rank=0, num_workers=2,
                                      token=cluster.token, job="parity")
            for group, _, names in groups:
                client.register_group(group, [(n, tuple(make_model("mlp").state_dict()[n].shape),
                                               "float32") for n in names], flatshard.Adam(lr=1e-2))
                fp32 = client.gather(group, 30, "float32")
                bf16 = client.gather(group, 30, "bfloat16")
                for name in names:
                    expected = torch.from_numpy(np.array(fp32[name])).to(torch.bfloat16)
                    got = torch.from_numpy(np.array(bf16[name])).view(torch.bfloat16)
                    self.assertTrue(torch.equal(got.view(torch.int16), expected.view(torch.int16)), name)

    def test_bf16_params_keep_an_fp32_master_initialized_at_full_precision(self):
        import flatshard.torch
        with checked_cluster.LocalCluster(servers=2, memory=MEMORY) as cluster:
            client = flatshard.Client(cluster.addresses, token=cluster.token, job="master")
            client.configure_job()
            original = make_model("mlp").state_dict()
            model = flatshard.torch.ShardedModule(make_model("mlp"), client, flatshard.Adam(lr=1e-2),
                                                  param_dtype=torch.bfloat16, auto_wrap_min_params=200)
            self.assertEqual(next(model.parameters()).dtype, torch.bfloat16)
            state = model.state_dict()
        for name, value in original.items():
            self.assertTrue(torch.equal(state[name], value), name)  # not bf16-rounded

    def test_full_export_loads_into_torch_and_reproduces_outputs(self):
        with checked_cluster.LocalCluster(servers=3, memory=MEMORY) as cluster, tempfile.TemporaryDirectory() as out:
            state = train_flatshard(cluster, "transformer", flatshard.AdamW(lr=5e-3), 5).state
            client = flatshard.Client(cluster.addresses, worker_rank=0, num_workers=2,
                                      token=cluster.token, job="parity")
            client.export_state_dict(out, kind="full")
            tensors, metadata = read_safetensors(os.path.join(out, "model.safetensors"))
        model = make_model("transformer")
        model.load_state_dict(tensors, strict=True)
        trained = make_model("transformer")
        trained.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()}, strict=True)
        x, _ = make_data("transformer")
        with torch.no_grad():
            self.assertTrue(torch.equal(model(x), trained(x)))
        self.assertIsInstance(metadata, dict)


if __name__ == "__main__":
    unittest.main()
