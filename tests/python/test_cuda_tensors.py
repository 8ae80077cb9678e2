"""CUDA tensors through the Python client: gathers into and scatters from device memory
move over CUDA IPC to --memory=device servers on the same GPU and give the bytes the
host path gives. Skipped where torch sees no CUDA device (CI); run on a GPU machine."""

import unittest

import numpy as np
import torch

import checked_cluster
import flatshard

# 1 MiB and more, and sizes that do not divide evenly over 2 servers.
TENSORS = [("w", (513, 511), "float32"), ("b", (7,), "float32")]


@unittest.skipUnless(torch.cuda.is_available(), "no CUDA device for torch on this machine")
class CudaTensorTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.cluster = checked_cluster.LocalCluster(servers=2, memory="device").start()

    @classmethod
    def tearDownClass(cls):
        cls.cluster.close()

    def client(self, job, rank=0, workers=1):
        return flatshard.Client(self.cluster.addresses, worker_rank=rank, num_workers=workers,
                                token=self.cluster.token, job=job)

    def test_gathers_into_cuda_tensors_equal_host_gathers_bitwise(self):
        c = self.client("gather")
        c.configure_job()
        layout = c.register_group("g", TENSORS, flatshard.SGD(lr=0.1))
        rng = np.random.default_rng(3)
        c.init_group("g", {n: rng.standard_normal(s).astype(np.float32) for n, s, _ in TENSORS})
        self.assertEqual(c.data_planes(), ["cuda-ipc", "cuda-ipc"])
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            host, _ = c.gather_flat("g", dtype=dtype)
            device = torch.full((layout.padded_numel,), float("nan"), dtype=dtype, device="cuda")
            _, version = c.gather_flat("g", dtype=dtype, out=device)
            self.assertEqual(version, 0)
            bits = torch.int16 if dtype != torch.float32 else torch.int32
            want = torch.as_tensor(np.asarray(host)).view(bits)
            self.assertTrue(torch.equal(device.view(bits).cpu(), want), dtype)

    def test_scatters_from_cuda_tensors_step_like_float64(self):
        clients = [self.client("scatter", rank, 2) for rank in range(2)]
        for c in clients:
            c.configure_job(reduce="mean")
            layout = c.register_group("g", TENSORS, flatshard.SGD(lr=0.5))
        init = np.random.default_rng(4).standard_normal(layout.padded_numel).astype(np.float32)
        clients[0].init_group("g", layout.views(init))
        grads = [torch.randn(layout.padded_numel, device="cuda") for _ in clients]
        pending = [c.scatter_async("g", g, 0) for c, g in zip(clients, grads)]
        for p in pending:
            p.wait()
        out = torch.empty(layout.padded_numel, device="cuda")
        _, version = clients[0].gather_flat("g", min_version=1, out=out)
        self.assertEqual(version, 1)
        mean = (grads[0].double() + grads[1].double()).cpu().numpy() / 2
        expected = init.astype(np.float64) - 0.5 * mean
        n = layout.unpadded_numel
        np.testing.assert_allclose(out.cpu().numpy()[:n], expected[:n], rtol=1e-6, atol=1e-6)
        for server in clients[0].status()["servers"]:
            self.assertGreaterEqual(int(server["ipc_scatters"]), 2, server)


if __name__ == "__main__":
    unittest.main()
