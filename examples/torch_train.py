#!/usr/bin/env python3
"""Trains a small PyTorch model with 2 worker processes on a local flatshard cluster,
saves a checkpoint, kills the cluster, starts a fresh one on the same checkpoint root,
loads the checkpoint and continues: the loss picks up where it stopped, the workers now
freeing each layer's parameters between its forward and its backward
(reshard_after_forward, FSDP's FULL_SHARD: the same numbers, less memory). Each worker
accumulates its half batch over 2 micro-batches (no_sync) and follows a cosine
learning-rate schedule: torch's LambdaLR over a ServerOptimizer, which stands for the
servers' optimizer, resumed at the loaded step. Biases train without weight decay
(param_groups, as torch optimizers take them). Last, the trained body is fine-tuned for
another task under a new head: a non-strict load of the same checkpoint (torch's
strict=False) takes the body and leaves the new head as initialized.

    PYTHONPATH=build/python /usr/bin/python3 examples/torch_train.py [--steps 40]
"""

import argparse
import collections
import contextlib
import math
import multiprocessing
import tempfile

import torch
import torch.nn.functional as F

import flatshard
import flatshard.torch


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 64),
                               torch.nn.GELU(), torch.nn.Linear(64, 4))


def batch(step, rank):
    """Worker `rank`'s half of step `step`'s batch of a fixed regression task."""
    generator = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(64, 16, generator=generator)
    y = torch.sin(x[:, :4] * 2.0) + 0.5 * x[:, 4:8]
    return x[rank * 32:(rank + 1) * 32], y[rank * 32:(rank + 1) * 32]


MICRO_BATCHES = 2


def learning_rate(step, total):
    """Cosine decay from 1e-2 to 1e-3 over `total` steps."""
    return 1e-3 + 0.5 * (1e-2 - 1e-3) * (1 + math.cos(math.pi * min(step, total) / total))


def worker(addresses, token, rank, first_step, steps, total_steps, checkpoint, reshard, queue):
    torch.set_num_threads(1)
    client = flatshard.Client(addresses, worker_rank=rank, num_workers=2, token=token)
    client.configure_job(max_grad_norm=1.0)
    net = make_model()
    biases = [p for p in net.parameters() if p.ndim < 2]
    model = flatshard.torch.ShardedModule(net, client, optimizer=flatshard.AdamW(lr=1e-2, weight_decay=0.01),
                                          param_groups=[{"params": biases, "weight_decay": 0.0}],
                                          auto_wrap_min_params=1000, load_checkpoint=checkpoint,
                                          reshard_after_forward=reshard)
    assert model.version == first_step, (model.version, first_step)
    optimizer = flatshard.torch.ServerOptimizer(model)
    for group in optimizer.param_groups:  # as a scheduler resumed from its state expects
        group.setdefault("initial_lr", group["lr"])
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: learning_rate(step, total_steps) / 1e-2, last_epoch=first_step - 1)
    losses, norms = [], []
    for step in range(first_step, first_step + steps):
        x, y = batch(step, rank)
        total = 0.0
        for micro, (xm, ym) in enumerate(zip(x.chunk(MICRO_BATCHES), y.chunk(MICRO_BATCHES))):
            # Gradients of all but the last micro-batch stay local; the last sends the sum.
            with model.no_sync() if micro < MICRO_BATCHES - 1 else contextlib.nullcontext():
                loss = F.mse_loss(model(xm), ym) / MICRO_BATCHES
                loss.backward()
            total += loss.item()
        optimizer.step()  # model.step()
        scheduler.step()  # the next step's learning rate, sent with its forward
        losses.append(total)
        norms.append(model.grad_norm())  # before clipping, as clip_grad_norm_ returns it
    queue.put((rank, losses, (model.groups, norms) if rank == 0 else None))


def make_fine_tune_model():
    """make_model's body (layers 0-3) under a new two-output head, named otherwise than
    its old head "4": the checkpoint holds the old one, this model the new one."""
    body = list(make_model())[:4]
    torch.manual_seed(1)
    return torch.nn.Sequential(collections.OrderedDict(
        [(str(i), layer) for i, layer in enumerate(body)] + [("task_head", torch.nn.Linear(64, 2))]))


def fine_tune(cluster, checkpoint, steps):
    """Trains the new task (one worker) from `checkpoint`'s body, loaded non-strictly."""
    client = flatshard.Client(cluster.addresses, token=cluster.token, job="fine-tune")
    client.configure_job()
    model = flatshard.torch.ShardedModule(make_fine_tune_model(), client, optimizer=flatshard.AdamW(lr=5e-3),
                                          load_checkpoint=checkpoint, load_strict=False)
    losses = []
    for step in range(steps):
        x, _ = batch(step, 0)
        loss = F.mse_loss(model(x), torch.tanh(x[:, :2] - x[:, 2:4]))
        loss.backward()
        model.step()
        losses.append(loss.item())
    return model.load_result, losses


def train(cluster, first_step, steps, total_steps, checkpoint=None, reshard=False):
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    processes = [context.Process(target=worker, args=(cluster.addresses, cluster.token, rank,
                                                      first_step, steps, total_steps, checkpoint,
                                                      reshard, queue))
                 for rank in range(2)]
    for p in processes:
        p.start()
    results = dict((rank, (losses, extra)) for rank, losses, extra in (queue.get(timeout=300) for _ in processes))
    for p in processes:
        p.join()
        if p.exitcode != 0:
            raise SystemExit(f"a worker failed (exit code {p.exitcode})")
    groups, norms = results[0][1]
    return [(a + b) / 2 for a, b in zip(results[0][0], results[1][0])], groups, norms


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=40, help="steps before and after the restart")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        with flatshard.LocalCluster(servers=2, checkpoint_root=root) as cluster:
            print(f"cluster 1: servers {cluster.addresses}")
            losses, groups, norms = train(cluster, 0, args.steps, 2 * args.steps)
            print(f"groups: {[name for name, _, _ in groups]}")
            print(f"steps 1-{args.steps}: loss {losses[0]:.4f} -> {losses[-1]:.4f}, "
                  f"gradient norm {norms[0]:.3f} -> {norms[-1]:.3f} (max_grad_norm 1.0)")
            client = flatshard.Client(cluster.addresses, num_workers=2, token=cluster.token)
            client.save_checkpoint("torch-example", kind="full", optimizer=True)
            print("saved FULL checkpoint 'torch-example' with optimizer state; stopping the cluster")
        with flatshard.LocalCluster(servers=2, checkpoint_root=root) as cluster:
            print(f"cluster 2: servers {cluster.addresses} (fresh processes, same checkpoint root)")
            resumed, _, _ = train(cluster, args.steps, args.steps, 2 * args.steps,
                                  checkpoint="torch-example", reshard=True)
            print(f"steps {args.steps + 1}-{2 * args.steps} after loading, with reshard_after_forward: "
                  f"loss {resumed[0]:.4f} -> {resumed[-1]:.4f}")
            keys, tuned = fine_tune(cluster, "torch-example", args.steps // 2)
            print(f"fine-tuning a new head on the loaded body (strict=False): missing {keys.missing_keys}, "
                  f"unexpected {keys.unexpected_keys}; loss {tuned[0]:.4f} -> {tuned[-1]:.4f}")
    if sorted(keys.missing_keys) != ["task_head.bias", "task_head.weight"] or \
            sorted(keys.unexpected_keys) != ["4.bias", "4.weight"]:
        raise SystemExit(f"the non-strict load left out {keys}, not just the two heads")
    if not tuned[-1] < tuned[0]:
        raise SystemExit("fine-tuning did not lower the new task's loss")
    # A fresh start would begin near the first loss; a resumed one near the last.
    if not abs(resumed[0] - losses[-1]) < abs(resumed[0] - losses[0]):
        raise SystemExit("the loss after the restart did not continue from the checkpoint")
    print("resumed where it stopped: OK")


if __name__ == "__main__":
    main()
