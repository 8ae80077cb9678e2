"""A training worker process for the parity tests: trains `kind` with ShardedModule on
its half of the batch (on `device`: "cpu" or "cuda"), in `micro_batches` pieces whose
gradients accumulate under no_sync() but for the last, with the learning rate set to
lr_schedule[step] (an lr, or (lr, k) for param_groups[k] alone) before the steps it
names, or by a torch scheduler (models.make_scheduler) over a ServerOptimizer, and
reports its losses, (worker 0) the final state dict, (a clipped job) the gradient norm
of every step and (with a GradScaler: init 2**10, growth every 3 steps) the final loss
scale."""

import torch
import torch.nn.functional as F

import flatshard
import flatshard.torch
from models import make_data, make_model, make_scheduler


def run(addresses, token, rank, kind, settings, job, steps, param_dtype, queue, device="cpu",
        micro_batches=1, lr_schedule=None, poison_step=None, grad_scaler=False, param_groups=None,
        scheduler=None, reshard_after_forward=False):
    try:
        torch.set_num_threads(1)
        client = flatshard.Client(addresses, worker_rank=rank, num_workers=2, token=token,
                                  job="parity", timeout=60.0)
        client.configure_job(**job)
        model = flatshard.torch.ShardedModule(make_model(kind).to(device), client, optimizer=settings,
                                              param_dtype=param_dtype,
                                              reduce_dtype=torch.float32 if param_dtype else None,
                                              auto_wrap_min_params=200, param_groups=param_groups,
                                              reshard_after_forward=reshard_after_forward)
        scaler = flatshard.torch.GradScaler(model, init_scale=2.0 ** 10, growth_interval=3) if grad_scaler else None
        scaled = scaler.scale if scaler else (lambda loss: loss)
        optimizer = flatshard.torch.ServerOptimizer(model) if scheduler else None
        schedule = make_scheduler(scheduler, optimizer, steps) if scheduler else None
        x, y = (t.to(device) for t in make_data(kind))
        half = x.shape[0] // 2
        x, y = x[rank * half:(rank + 1) * half], y[rank * half:(rank + 1) * half]
        losses, norms = [], []
        micro = x.shape[0] // micro_batches
        for step in range(steps):
            if lr_schedule and step in lr_schedule:
                change = lr_schedule[step]
                lr, param_group = change if isinstance(change, tuple) else (change, None)
                model.set_hyperparams(lr=lr, param_group=param_group)
            total = 0.0
            for m in range(micro_batches):
                piece = slice(m * micro, (m + 1) * micro)
                # The mean over the half batch: each piece's mean, over micro_batches.
                if m < micro_batches - 1:
                    with model.no_sync():
                        loss = F.mse_loss(model(x[piece]).float(), y[piece]) / micro_batches
                        scaled(loss).backward()
                else:
                    loss = F.mse_loss(model(x[piece]).float(), y[piece]) / micro_batches
                    if step == poison_step and rank == 1:
                        # Same loss, gradients times inf (NaN where they are 0): a bad batch.
                        scaled(loss + float("inf") * (loss - loss.detach())).backward()
                    else:
                        scaled(loss).backward()
                total += loss.item()
            if scaler:
                norms.append(scaler.step())
            else:
                if optimizer:
                    optimizer.step()
                    schedule.step()
                else:
                    model.step()
                if job.get("max_grad_norm"):
                    norms.append(model.grad_norm())
            losses.append(total)
        state = {k: v.cpu().numpy() for k, v in model.state_dict().items()} if rank == 0 else None
        queue.put((rank, (losses, state, model.groups, norms, scaler.get_scale() if scaler else None), None))
    except BaseException as e:  # report instead of hanging the test
        queue.put((rank, None, repr(e)))
