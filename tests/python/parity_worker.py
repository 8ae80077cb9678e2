"""A training worker process for the parity tests: trains `kind` with ShardedModule on
its half of the batch (on `device`: "cpu" or "cuda") and reports its losses and
(worker 0) the final state dict."""

import torch
import torch.nn.functional as F

import flatshard
import flatshard.torch
from models import make_data, make_model


def run(addresses, token, rank, kind, optimizer, job, steps, param_dtype, queue, device="cpu"):
    try:
        torch.set_num_threads(1)
        client = flatshard.Client(addresses, worker_rank=rank, num_workers=2, token=token,
                                  job="parity", timeout=60.0)
        client.configure_job(**job)
        model = flatshard.torch.ShardedModule(make_model(kind).to(device), client, optimizer=optimizer,
                                              param_dtype=param_dtype,
                                              reduce_dtype=torch.float32 if param_dtype else None,
                                              auto_wrap_min_params=200)
        x, y = (t.to(device) for t in make_data(kind))
        half = x.shape[0] // 2
        x, y = x[rank * half:(rank + 1) * half], y[rank * half:(rank + 1) * half]
        losses = []
        for _ in range(steps):
            loss = F.mse_loss(model(x).float(), y)
            loss.backward()
            model.step()
            losses.append(loss.item())
        state = {k: v.cpu().numpy() for k, v in model.state_dict().items()} if rank == 0 else None
        queue.put((rank, losses, state, model.groups, None))
    except BaseException as e:  # report instead of hanging the test
        queue.put((rank, None, None, None, repr(e)))
