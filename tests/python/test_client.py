"""flatshard.Client and flatshard.LocalCluster: the public Python surface, its numerics
against numpy float64, and its errors (each a flatshard.Error subclass, raised
promptly)."""

import gc
import json
import os
import signal
import socket
import subprocess
import tempfile
import threading
import time
import unittest

import numpy as np
import torch

import checked_cluster
import flatshard
from safetensors_reader import read_safetensors, write_safetensors

TENSORS = [("weight", (4, 3), "float32"), ("bias", (4,), "float32")]
# The servers' memory tier: FLATSHARD_TEST_MEMORY=device|pinned runs the suite over a GPU
# tier (on a machine with one).
MEMORY = os.environ.get("FLATSHARD_TEST_MEMORY") or "host"


def values(seed):
    rng = np.random.default_rng(seed)
    return {"weight": rng.standard_normal((4, 3)).astype(np.float32),
            "bias": rng.standard_normal(4).astype(np.float32)}


class ClientTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.root = tempfile.TemporaryDirectory()
        cls.cluster = checked_cluster.LocalCluster(servers=3, checkpoint_root=cls.root.name,
                                                   memory=MEMORY).start()

    @classmethod
    def tearDownClass(cls):
        cls.cluster.close()
        cls.root.cleanup()

    def client(self, rank=0, workers=1, job="default", **kw):
        return flatshard.Client(self.cluster.addresses, worker_rank=rank, num_workers=workers,
                                token=self.cluster.token, job=job, **kw)

    def assert_ctrl_c_ends(self, call, within):
        """Ctrl-C (SIGINT to this thread) 0.3 s into `call` raises KeyboardInterrupt in
        under `within` seconds."""
        timer = threading.Timer(0.3, signal.pthread_kill, args=(threading.get_ident(), signal.SIGINT))
        start = time.monotonic()
        timer.start()
        try:
            with self.assertRaises(KeyboardInterrupt):
                call()
            self.assertLess(time.monotonic() - start, within)
        finally:
            timer.join()

    def test_two_workers_sgd_step_matches_float64(self):
        clients = [self.client(r, 2, job="sgd") for r in range(2)]
        for c in clients:
            c.configure_job(reduce="mean")
            c.register_group("g", TENSORS, flatshard.SGD(lr=0.1, momentum=0.9))
        init = values(1)
        clients[0].init_group("g", init)
        grads = [values(10), values(11)]
        threads = [threading.Thread(target=c.scatter, args=("g", grads[r], 0)) for r, c in enumerate(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self.assertEqual(clients[0].version("g"), 1)
        params = clients[1].gather("g", min_version=1)
        for name in ("weight", "bias"):
            mean = (grads[0][name].astype(np.float64) + grads[1][name]) / 2
            expected = init[name].astype(np.float64) - 0.1 * mean  # first momentum step: buf = g
            np.testing.assert_allclose(params[name], expected, rtol=1e-6, atol=1e-7)
            self.assertEqual(params[name].shape, init[name].shape)

    def test_transfers_say_when_they_are_done_and_answer_every_wait(self):
        clients = [self.client(r, 2, job="done") for r in range(2)]
        for c in clients:
            c.configure_job()
            c.register_group("g", TENSORS, flatshard.SGD(lr=0.5))
        clients[0].init_group("g", values(1))

        def finished(transfer):
            deadline = time.monotonic() + 30
            while not transfer.done() and time.monotonic() < deadline:
                time.sleep(0.01)
            return transfer.done()

        scattered = clients[0].scatter_async("g", values(2), 0)
        self.assertTrue(finished(scattered))
        self.assertIsNone(scattered.wait())
        self.assertIsNone(scattered.wait())
        # Version 1 needs worker 1's gradient too: the gather waits for it.
        gathered = clients[1].gather_async("g", min_version=1)
        time.sleep(0.2)
        self.assertFalse(gathered.done())
        clients[1].scatter("g", values(3), 0)
        self.assertTrue(finished(gathered))
        flat, version = gathered.wait()
        self.assertEqual(version, 1)
        again, version_again = gathered.wait()
        self.assertIs(again, flat)
        self.assertEqual(version_again, 1)
        resent = clients[0].scatter_async("g", values(2), 0)
        self.assertTrue(finished(resent))
        for _ in range(2):
            with self.assertRaises(flatshard.AlreadyExistsError):
                resent.wait()

    def test_a_group_of_many_small_tensors_trains_by_name(self):
        # A model left in one group: 20000 named tensors, each value where its name says.
        c = self.client(job="many-tensors")
        c.configure_job()
        names = [f"layers.{i}.scale" for i in range(20000)]
        c.register_group("root", [(n, (3,), "float32") for n in names], flatshard.SGD(lr=0.5))
        init = {n: np.full(3, i, np.float32) for i, n in enumerate(names)}
        c.init_group("root", init)
        grads = {n: np.full(3, i % 7, np.float32) for i, n in enumerate(names)}
        c.scatter("root", grads, step=0)
        params = c.gather("root", min_version=1)
        self.assertEqual(len(params), len(names))
        for i, n in enumerate(names):
            np.testing.assert_array_equal(params[n], init[n] - 0.5 * grads[n], err_msg=n)

    def test_gathers_in_16_bit_are_exact_casts_and_torch_tensors_are_accepted(self):
        c = self.client(job="cast")
        c.configure_job()
        c.register_group("g", TENSORS, flatshard.Adam(lr=1e-3))
        init = values(2)
        c.init_group("g", {k: torch.from_numpy(v) for k, v in init.items()})
        bf16 = c.gather("g", dtype=torch.bfloat16)
        fp16 = c.gather("g", dtype="float16")
        for name, value in init.items():
            expected = torch.from_numpy(value).to(torch.bfloat16).view(torch.int16).numpy()
            np.testing.assert_array_equal(bf16[name], expected)
            np.testing.assert_array_equal(fp16[name], value.astype(np.float16))

    def test_zero_dim_tensors_keep_their_shape(self):
        c = self.client(job="scalar")
        c.configure_job()
        c.register_group("g", [("scale", (), "float32"), ("bias", (2,), "float32")],
                         flatshard.SGD(lr=0.5))
        c.init_group("g", {"scale": np.float32(3.0), "bias": np.array([1, 2], np.float32)})
        c.scatter("g", {"scale": np.array(2.0, np.float32), "bias": np.zeros(2, np.float32)}, 0)
        params = c.gather("g", min_version=1)
        self.assertEqual(params["scale"].shape, ())
        self.assertEqual(float(params["scale"]), 2.0)  # 3 - 0.5 * 2

    def test_torch_tensors_cross_by_dlpack(self):
        c = self.client(job="dlpack")
        c.configure_job(reduce="sum")
        layout = c.register_group("g", TENSORS, flatshard.SGD(lr=1.0))
        init = values(6)
        c.init_group("g", init)
        out = torch.full((layout.padded_numel,), float("nan"))
        flat, version = c.gather_flat("g", out=out)
        self.assertIs(flat, out)
        self.assertEqual(version, 0)
        np.testing.assert_array_equal(out[:12].view(4, 3).numpy(), init["weight"])
        bf16 = torch.zeros(layout.padded_numel, dtype=torch.bfloat16)
        c.gather_flat("g", dtype=torch.bfloat16, out=bf16)
        self.assertTrue(torch.equal(bf16, out.to(torch.bfloat16)))
        grad = torch.ones(layout.padded_numel)
        c.scatter("g", grad, step=0)  # a flat torch tensor
        np.testing.assert_array_equal(c.gather("g", 1)["bias"], init["bias"] - 1.0)
        with self.assertRaises(flatshard.InvalidArgumentError):
            c.gather_flat("g", out=torch.zeros(3))
        with self.assertRaises(flatshard.InvalidArgumentError):
            c.scatter("g", torch.ones(layout.padded_numel, dtype=torch.float64), step=1)

    def test_set_hyperparams_changes_the_next_step(self):
        c = self.client(job="hp")
        c.configure_job(reduce="sum")
        c.register_group("g", TENSORS, flatshard.SGD(lr=1.0))
        c.init_group("g", {"weight": np.zeros((4, 3), np.float32), "bias": np.zeros(4, np.float32)})
        ones = {"weight": np.ones((4, 3), np.float32), "bias": np.ones(4, np.float32)}
        c.scatter("g", ones, step=0)
        c.set_hyperparams("g", lr=0.25)
        c.scatter("g", ones, step=1)
        np.testing.assert_array_equal(c.gather("g", 2)["bias"], np.full(4, -1.25, np.float32))
        with self.assertRaises(flatshard.InvalidArgumentError):
            c.set_hyperparams("g", betas=(0.9, 0.9))
        # Several groups in one call; one refused changes none of them.
        c.register_group("h", TENSORS, flatshard.SGD(lr=1.0))
        c.set_hyperparams_of(["g", "h"], lr=0.5)
        with self.assertRaises(flatshard.InvalidArgumentError) as refused:
            c.set_hyperparams_of(["g", "h"], lr=-1.0)
        self.assertIn("group 'g': ", refused.exception.message)
        with self.assertRaises(flatshard.NotFoundError):
            c.set_hyperparams_of(["g", "nope"], lr=2.0)
        c.scatter("g", ones, step=2)
        c.scatter("h", ones, step=0)
        np.testing.assert_array_equal(c.gather("g", 3)["bias"], np.full(4, -1.75, np.float32))
        np.testing.assert_array_equal(c.gather("h", 1)["bias"], np.full(4, -0.5, np.float32))

    def test_set_hyperparams_of_groups_sharing_an_optimizer_keeps_each_groups_own_settings(self):
        c = self.client(job="hp-shared")
        c.configure_job(reduce="sum")
        shared = flatshard.SGD(lr=1.0)
        c.register_group("g", TENSORS, shared)
        c.register_group("h", TENSORS, shared)
        c.register_group("k", TENSORS, flatshard.SGD(lr=1.0, weight_decay=0.5))
        ones = {"weight": np.ones((4, 3), np.float32), "bias": np.ones(4, np.float32)}
        for name in "ghk":
            c.init_group(name, ones)
        c.set_hyperparams_of(["g", "h", "k"], lr=0.5)
        c.set_hyperparams("g", lr=0.25)  # g alone, though it shared h's settings
        for name in "ghk":
            c.scatter(name, ones, step=0)
        # p - lr * (grad + weight_decay * p), from p = 1 and grad = 1.
        for name, expected in (("g", 0.75), ("h", 0.5), ("k", 0.25)):
            np.testing.assert_array_equal(c.gather(name, 1)["bias"], np.full(4, expected, np.float32), name)
        self.assertEqual(shared, flatshard.SGD(lr=1.0), "the caller's object is left as it was")

    def test_a_frozen_group_keeps_its_values_and_refuses_gradients(self):
        c = self.client(job="frozen")
        c.configure_job()
        c.register_group("backbone", TENSORS, flatshard.Frozen())
        init = values(4)
        c.init_group("backbone", init)
        with self.assertRaises(flatshard.FailedPreconditionError) as refused:
            c.scatter("backbone", values(5), 0)
        self.assertIn("is frozen", refused.exception.message)
        with self.assertRaises(flatshard.InvalidArgumentError):
            c.set_hyperparams("backbone", lr=0.1)  # a frozen group has none
        self.assertEqual(c.version("backbone"), 0)
        params = c.gather("backbone")
        for name in ("weight", "bias"):
            np.testing.assert_array_equal(params[name], init[name])

    def test_an_average_group_takes_the_workers_mean_in_a_sum_job(self):
        workers = [self.client(rank=r, workers=2, job="buffers") for r in range(2)]
        workers[0].configure_job(reduce="sum", max_grad_norm=1e-3)  # neither sums nor clips it
        for c in workers:
            c.register_group("running", TENSORS, flatshard.Average())
        sent = [values(6), values(7)]
        for c, v in zip(workers, sent):
            c.scatter("running", v, 0)
        params = workers[1].gather("running", 1)
        for name in ("weight", "bias"):
            np.testing.assert_array_equal(params[name], (sent[0][name] + sent[1][name]) * np.float32(0.5))
        asynchronous = self.client(job="buffers-async")
        asynchronous.configure_job(mode="async")
        with self.assertRaises(flatshard.InvalidArgumentError) as refused:
            asynchronous.register_group("running", TENSORS, flatshard.Average())
        self.assertIn("optimizer average (module buffers) needs a SYNC job", refused.exception.message)

    def test_checkpoints_are_shared_by_clusters_on_the_same_root(self):
        c = self.client(job="ckpt")
        c.configure_job()
        c.register_group("g", TENSORS, flatshard.AdamW(lr=1e-2))
        c.init_group("g", values(3))
        c.scatter("g", values(4), step=0)
        before = c.gather("g", 1)
        c.save_checkpoint("py-ckpt", kind="sharded", optimizer=True)
        names = [e["name"] for e in c.list_checkpoints() if e["complete"]]
        self.assertIn("py-ckpt", names)
        with checked_cluster.LocalCluster(servers=2, checkpoint_root=self.root.name,
                                          memory=MEMORY) as other:
            d = flatshard.Client(other.addresses, token=other.token, job="ckpt")
            d.configure_job()
            d.register_group("g", TENSORS, flatshard.AdamW(lr=1e-2))
            self.assertEqual(d.load_checkpoint("py-ckpt"), flatshard.IncompatibleKeys([], []))  # 3 servers -> 2
            after = d.gather("g", 1)
            self.assertEqual(d.version("g"), 1)
            # Non-strict, into a job with another group beside it: "g" loads, "head" stays.
            e = flatshard.Client(other.addresses, token=other.token, job="tune")
            e.configure_job()
            e.register_group("g", TENSORS, flatshard.AdamW(lr=1e-2))
            e.register_group("head", [("head.weight", (3,), "float32")], flatshard.SGD(lr=0.1))
            e.init_group("head", {"head.weight": np.arange(3, dtype=np.float32)})
            with self.assertRaises(flatshard.FailedPreconditionError) as refused:
                e.load_checkpoint("py-ckpt")
            self.assertIn("tensor 'head.weight' of group 'head' of job 'tune' is not in checkpoint 'py-ckpt'",
                          refused.exception.message)
            keys = e.load_checkpoint("py-ckpt", strict=False)
            self.assertEqual((keys.missing_keys, keys.unexpected_keys), (["head.weight"], []))
            tuned = e.gather("g", 1)
            np.testing.assert_array_equal(e.gather("head", 1)["head.weight"], np.arange(3, dtype=np.float32))
        for name in before:
            np.testing.assert_array_equal(after[name], before[name])
            np.testing.assert_array_equal(tuned[name], before[name])

    def test_an_operators_save_at_the_step_boundary_waits_for_the_step_in_progress(self):
        workers = [self.client(r, 2, job="cut") for r in range(2)]
        gain = [("gain", (1,), "float32")]
        for w in workers:
            w.configure_job()
            w.register_group("a", TENSORS, flatshard.SGD(lr=0.1))
            w.register_group("b", gain, flatshard.SGD(lr=0.1))
        b_grad = {"gain": np.ones(1, np.float32)}
        for w in workers:
            w.scatter("a", values(5), 0)
        workers[0].scatter("b", b_grad, 0)  # step 0 is in progress: "b" waits for worker 1
        operator = self.client(job="cut")
        outcome = []
        saving = threading.Thread(
            target=lambda: outcome.append(operator.save_checkpoint("py-cut", kind="sharded", cut="boundary")))
        saving.start()
        saving.join(0.3)
        self.assertTrue(saving.is_alive(), "the save did not wait for the step in progress")
        workers[1].scatter("b", b_grad, 0)
        saving.join()
        self.assertEqual(outcome, [None])
        saved = {e["name"]: e["versions"] for e in operator.list_checkpoints()}
        self.assertEqual(saved["py-cut"], {"a": 1, "b": 1})
        with self.assertRaises(flatshard.FailedPreconditionError):
            operator.save_checkpoint("py-cut-0", cut=0)  # both groups are past version 0
        with self.assertRaises(flatshard.InvalidArgumentError):
            operator.export_state_dict(self.root.name + "/unused", cut="soon")

    def test_wait_versions_answers_for_several_groups_in_one_call(self):
        c = self.client(job="waits")
        c.configure_job()
        for name in ("a", "b"):
            c.register_group(name, TENSORS, flatshard.SGD(lr=0.1))
        self.assertEqual(c.wait_versions(["a", "b"], 0), [0, 0])
        c.scatter("a", values(1), 0)
        self.assertEqual(c.wait_versions(("b", "a"), 0), [0, 1])
        self.assertEqual(c.wait_versions(["a"], 1), [1])
        start = time.monotonic()
        with self.assertRaises(flatshard.NotFoundError) as missing:
            c.wait_versions(["a", "nope"], 2)  # refused before any wait
        self.assertIn("'nope'", missing.exception.message)
        self.assertLess(time.monotonic() - start, 5)
        with self.assertRaises(flatshard.InvalidArgumentError):
            c.wait_versions([], 0)

    def test_a_load_ends_a_wait_for_a_version_it_took_away(self):
        workers = [self.client(r, 2, job="reload") for r in range(2)]
        for w in workers:
            w.configure_job()
            w.register_group("g", TENSORS, flatshard.SGD(lr=0.1))
        workers[0].save_checkpoint("py-reload", kind="sharded")
        workers[1].gather_flat("g")  # the state worker 1 computes its gradient from
        workers[0].scatter("g", values(5), 0)  # worker 1's gradient is still to come
        outcome = []

        def wait():
            try:
                outcome.append(workers[0].wait_version("g", 1))
            except flatshard.Error as e:
                outcome.append(e)

        waiting = threading.Thread(target=wait)
        waiting.start()
        operator = self.client(job="reload")
        for _ in range(30):  # a load before the wait reaches the servers does not end it
            waiting.join(0.1)
            if not waiting.is_alive():
                break
            operator.load_checkpoint("py-reload")
        waiting.join()
        self.assertIsInstance(outcome[0], flatshard.AbortedError)
        self.assertIn("loaded from a checkpoint at version 0 while waiting for version 1", outcome[0].message)
        # Worker 1's gradient comes from the state the load replaced, at the same version:
        # refused until it gathers the loaded state (worker 0 never gathered: unchecked).
        with self.assertRaises(flatshard.AbortedError) as replaced:
            workers[1].scatter("g", values(6), 0)
        self.assertIn("the group now holds the state of checkpoint load", replaced.exception.message)
        workers[1].gather_flat("g")
        for r, w in enumerate(workers):  # the load dropped worker 0's gradient: both send it
            w.scatter("g", values(5 + r), 0)
        self.assertEqual(workers[1].wait_version("g", 1), 1)
        # Every server holds the state of the last load, under one id.
        loads = {g["load_id"] for s in operator.status()["servers"] for g in s["groups"]
                 if g["job"] == "reload"}
        self.assertEqual(len(loads), 1, loads)
        self.assertNotEqual(loads, {"0"})

    def test_full_export_is_a_safetensors_file_torch_loads(self):
        c = self.client(job="export")
        c.configure_job()
        c.register_group("g", TENSORS, flatshard.SGD(lr=0.1))
        init = values(5)
        c.init_group("g", init)
        calls = []
        with tempfile.TemporaryDirectory() as out:
            c.export_state_dict(out, kind="full", progress=lambda done, total: calls.append((done, total)))
            tensors, _ = read_safetensors(os.path.join(out, "model.safetensors"))
            size = os.path.getsize(os.path.join(out, "model.safetensors"))
            # A callback that raises cancels the export, and its error is raised.
            def fail(done, total):
                raise ValueError("stop drawing")
            with self.assertRaisesRegex(ValueError, "stop drawing"):
                c.export_state_dict(os.path.join(out, "again"), kind="full", progress=fail)
            self.assertEqual(os.listdir(os.path.join(out, "again")), [])
        self.assertTrue(calls)
        self.assertEqual(calls[-1], (size, size))
        self.assertTrue(all(done <= total for done, total in calls))
        module = torch.nn.Linear(3, 4)
        module.load_state_dict(tensors, strict=True)
        np.testing.assert_array_equal(module.weight.detach().numpy(), init["weight"])

    def test_an_export_imported_into_another_cluster_trains_on_exactly(self):
        # Two groups (Adam, and SGD with momentum) trained 3 steps on a 2-server cluster
        # without a checkpoint root, exported with their optimizer state (FULL, then
        # SHARDED: a SHARDED checkpoint, resharded by the load), imported into this
        # 3-server cluster and loaded into another job: values, versions, and the next
        # step (moments, step counts, momentum) are those of the source, bitwise.
        groups = {"a": (TENSORS, flatshard.Adam(lr=0.01)),
                  "s": ([("w2", (5,), "float32")], flatshard.SGD(lr=0.1, momentum=0.9))}
        rng = np.random.default_rng(7)
        grad = lambda g: {n: rng.standard_normal(shape).astype(np.float32) for n, shape, _ in groups[g][0]}
        for kind in ("full", "sharded"):
            with self.subTest(kind=kind), checked_cluster.LocalCluster(servers=2, memory=MEMORY) as source_cluster, \
                    tempfile.TemporaryDirectory() as out:
                source = flatshard.Client(source_cluster.addresses, token=source_cluster.token, job="src")
                source.configure_job()
                for name, (tensors, optimizer) in groups.items():
                    source.register_group(name, tensors, optimizer)
                source.init_group("a", values(1))
                source.init_group("s", {"w2": np.arange(5, dtype=np.float32)})
                for step in range(3):
                    for name in groups:
                        source.scatter(name, grad(name), step)
                source.export_state_dict(out, kind=kind, optimizer=True)
                c = self.client(job=f"imported-{kind}")
                calls = []
                imported = c.import_checkpoint(f"from-{kind}", out,
                                               progress=lambda done, total: calls.append((done, total)))
                self.assertEqual(imported["kind"], kind)
                self.assertEqual(sorted(imported["groups"]), ["a", "s"])
                self.assertTrue(imported["optimizer"])
                size = sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out))
                self.assertEqual(imported["bytes"], size)
                self.assertEqual(calls[-1], (size, size))
                listed = {e["name"]: e for e in c.list_checkpoints()}[f"from-{kind}"]
                self.assertTrue(listed["complete"])
                self.assertEqual(listed["kind"], kind)
                self.assertEqual(listed["servers"], 2 if kind == "sharded" else 0)  # the shards it came in
                self.assertEqual(listed["versions"], {"a": 3, "s": 3})
                c.configure_job()
                for name, (tensors, optimizer) in groups.items():
                    c.register_group(name, tensors, optimizer)
                c.load_checkpoint(f"from-{kind}")
                for name in groups:
                    self.assertEqual(c.version(name), 3)
                    expected, got = source.gather(name, 3), c.gather(name, 3)
                    for fqn in expected:
                        np.testing.assert_array_equal(got[fqn], expected[fqn])
                for name in groups:
                    g = grad(name)
                    source.scatter(name, g, 3)
                    c.scatter(name, g, 3)
                    expected, got = source.gather(name, 4), c.gather(name, 4)
                    for fqn in expected:
                        np.testing.assert_array_equal(got[fqn], expected[fqn])
                c.delete_checkpoint(f"from-{kind}")
                if kind == "sharded":  # weights only: the versions, not the optimizer state
                    imported = c.import_checkpoint("weights", out, optimizer=False)
                    self.assertFalse(imported["optimizer"])
                    weights = self.client(job="weights")
                    weights.configure_job()
                    weights.register_group("s", *groups["s"])
                    weights.load_checkpoint("weights", strict=False)
                    self.assertEqual(weights.version("s"), 3)
                    before = weights.gather("s", 3)["w2"]
                    step = {"w2": np.ones(5, np.float32)}
                    weights.scatter("s", step, 3)  # momentum afresh: buf = g, p -= lr * g
                    np.testing.assert_allclose(weights.gather("s", 4)["w2"], before - 0.1, rtol=1e-6)
                    c.delete_checkpoint("weights")

    def test_a_torch_written_file_imports_as_weights(self):
        # A model.safetensors as torch or Hugging Face tools write it (no optimizer state,
        # no flatshard metadata, a bfloat16 tensor), split with its index: one group at the
        # version asked, loaded by name into groups wrapped otherwise; the optimizer starts
        # afresh.
        weight = torch.randn(4, 3)
        bias = torch.randn(4)
        head = torch.randn(2, 4).to(torch.bfloat16)
        with tempfile.TemporaryDirectory() as out:
            write_safetensors(os.path.join(out, "model-00001-of-00002.safetensors"), {"weight": weight, "bias": bias},
                              {"format": "pt"})
            write_safetensors(os.path.join(out, "model-00002-of-00002.safetensors"), {"head": head})
            with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
                json.dump({"metadata": {"total_size": 0}, "weight_map": {
                    "weight": "model-00001-of-00002.safetensors", "bias": "model-00001-of-00002.safetensors",
                    "head": "model-00002-of-00002.safetensors"}}, f)
            with open(os.path.join(out, "README.md"), "w") as f:
                f.write("not sent")
            c = self.client(job="torch-file")
            imported = c.import_checkpoint("torch-file", out, version=5)
        self.assertEqual(imported["groups"], ["imported"])
        self.assertFalse(imported["optimizer"])
        c.configure_job()
        c.register_group("body", TENSORS, flatshard.SGD(lr=0.5, momentum=0.9))
        c.register_group("head", [("head", (2, 4), "bfloat16")], flatshard.SGD(lr=0.5))
        c.load_checkpoint("torch-file")
        self.assertEqual(c.version("body"), 5)
        got = c.gather("body", 5)
        np.testing.assert_array_equal(got["weight"], weight.numpy())
        np.testing.assert_array_equal(got["bias"], bias.numpy())
        np.testing.assert_array_equal(c.gather("head", 5)["head"], head.float().numpy())
        step = {"weight": np.ones((4, 3), np.float32), "bias": np.ones(4, np.float32)}
        c.scatter("body", step, 5)  # momentum afresh: buf = g, p -= lr * g
        np.testing.assert_allclose(c.gather("body", 6)["weight"], weight.numpy() - 0.5, rtol=1e-6)
        c.delete_checkpoint("torch-file")

    def test_an_import_of_what_is_not_a_state_dict_is_refused_and_leaves_nothing(self):
        c = self.client(job="bad-import")

        def names():
            return {e["name"] for e in c.list_checkpoints()}

        before = names()
        with tempfile.TemporaryDirectory() as out:
            with self.assertRaisesRegex(flatshard.NotFoundError, "holds no model.safetensors"):
                c.import_checkpoint("bad", out)
            path = os.path.join(out, "model.safetensors")
            with open(path, "wb") as f:
                f.write(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}      ")
            with self.assertRaisesRegex(flatshard.InvalidArgumentError, "model.safetensors"):
                c.import_checkpoint("bad", out)
            self.assertEqual(names(), before)
            # A model tensor the optimizer metadata puts in no group.
            write_safetensors(path, {"weight": torch.ones(4, 3), "bias": torch.ones(4)})
            write_safetensors(os.path.join(out, "optimizer.safetensors"),
                              {"weight.momentum_buffer": torch.zeros(4, 3)},
                              {"g.params": "weight", "g.optimizer": "sgd", "g.step": "1"})
            with self.assertRaisesRegex(flatshard.InvalidArgumentError,
                                        "model tensor 'bias' is in no group of the optimizer metadata"):
                c.import_checkpoint("bad", out)
            # Optimizer state of another shape.
            write_safetensors(os.path.join(out, "optimizer.safetensors"),
                              {"weight.momentum_buffer": torch.zeros(3, 4), "bias.momentum_buffer": torch.zeros(4)},
                              {"g.params": "weight,bias", "g.optimizer": "sgd", "g.step": "1"})
            with self.assertRaisesRegex(flatshard.InvalidArgumentError, "'weight.momentum_buffer' must be float32"):
                c.import_checkpoint("bad", out)
            self.assertEqual(names(), before)
            self.assertEqual(os.listdir(self.root.name).count(".bad.partial"), 0)
            # A SHARDED export's file beside the FULL state dict: which one is meant?
            open(os.path.join(out, "shard-0.safetensors"), "wb").close()
            with self.assertRaisesRegex(flatshard.InvalidArgumentError,
                                        "holds a FULL state dict .model.safetensors. and a SHARDED one"):
                c.import_checkpoint("bad", out)
            os.remove(os.path.join(out, "shard-0.safetensors"))
            # Without the optimizer files it is a weights-only import; a second one of the
            # name is refused.
            self.assertFalse(c.import_checkpoint("bad", out, optimizer=False)["optimizer"])
            sent = []  # refused before any file goes
            with self.assertRaises(flatshard.AlreadyExistsError):
                c.import_checkpoint("bad", out, optimizer=False, progress=lambda done, total: sent.append(done))
            self.assertEqual(sent, [])
            # Cancelled mid-stream (chunks of 1 MiB), it leaves nothing either.
            write_safetensors(path, {"big": torch.zeros(1 << 20)})
            os.remove(os.path.join(out, "optimizer.safetensors"))
            with self.assertRaisesRegex(flatshard.CancelledError, "was cancelled"):
                c.import_checkpoint("cancelled", out, progress=lambda done, total: c.cancel_checkpoint_calls())
            deadline = time.monotonic() + 10  # server 0 drops it as soon as it sees the stream gone
            while "cancelled" in names() and time.monotonic() < deadline:
                time.sleep(0.01)
            self.assertNotIn("cancelled", names())
        c.delete_checkpoint("bad")
        self.assertEqual(names(), before)

    def test_ctrl_c_or_a_cancel_stops_an_export_and_names_no_file(self):
        c = self.client(job="interrupted")
        c.configure_job()
        c.register_group("g", TENSORS, flatshard.SGD(lr=0.1))
        c.init_group("g", values(3))
        main = threading.get_ident()
        calls = []

        def ctrl_c(done, total):
            # Ctrl-C while this stream is held here (the export cannot end meanwhile).
            calls.append(done)
            if len(calls) == 1:
                signal.pthread_kill(main, signal.SIGINT)
                time.sleep(1.0)

        with tempfile.TemporaryDirectory() as out:
            start = time.monotonic()
            with self.assertRaises(KeyboardInterrupt):
                c.export_state_dict(out, kind="full", progress=ctrl_c)
            self.assertLess(time.monotonic() - start, 30.0)
            self.assertEqual(os.listdir(out), [])
            with self.assertRaisesRegex(flatshard.CancelledError, "was cancelled; the servers keep nothing of it"):
                c.export_state_dict(out, kind="sharded", progress=lambda done, total: c.cancel_checkpoint_calls())
            self.assertEqual(os.listdir(out), [])
            c.export_state_dict(out, kind="full")  # the servers serve on
            self.assertEqual(os.listdir(out), ["model.safetensors"])

    def test_ctrl_c_or_a_cancel_stops_a_gather_waiting_for_a_version(self):
        c = self.client(job="gather-interrupted", timeout=60.0)
        c.configure_job()
        c.register_group("g", TENSORS, flatshard.SGD(lr=0.1))
        c.init_group("g", values(3))
        pending = c.gather_async("g", min_version=1)  # no step comes: it waits up to 60 s
        self.assert_ctrl_c_ends(pending.wait, within=30.0)
        stopped = "the gather of group 'g' was stopped"
        with self.assertRaisesRegex(flatshard.CancelledError, stopped):  # at once, not in 60 s
            pending.wait()
        self.assertTrue(pending.done())
        pending = c.gather_async("g", min_version=1)
        time.sleep(0.2)
        self.assertFalse(pending.done())
        start = time.monotonic()
        pending.cancel()
        with self.assertRaisesRegex(flatshard.CancelledError, stopped):
            pending.wait()
        self.assertLess(time.monotonic() - start, 30.0)
        before, _ = c.gather_flat("g")
        c.scatter("g", values(4), step=0)  # the client and the servers serve on
        flat, version = c.gather_flat("g", min_version=1)
        self.assertEqual(version, 1)
        self.assertFalse(np.array_equal(flat, before))

    def test_ctrl_c_stops_a_wait_for_a_version_or_a_norm(self):
        c = self.client(job="waits-interrupted", timeout=60.0)
        c.configure_job(max_grad_norm=1.0)
        c.register_group("g", TENSORS, flatshard.SGD(lr=0.1))
        c.init_group("g", values(3))
        for wait in (lambda: c.wait_version("g", 1), lambda: c.grad_norm(0)):  # no step comes: up to 60 s
            self.assert_ctrl_c_ends(wait, within=30.0)
        c.scatter("g", values(4), step=0)  # the client serves on
        self.assertEqual(c.wait_version("g", 1), 1)
        self.assertGreater(c.grad_norm(0), 0.0)

    def test_ctrl_c_ends_any_call_to_a_server_that_stopped_answering(self):
        c = self.client(job="calls-interrupted", timeout=60.0)
        c.configure_job()
        c.register_group("g", TENSORS, flatshard.SGD(lr=0.1))
        calls = {
            "configure_job": c.configure_job,
            "delete_job": c.delete_job,
            "register_group": lambda: c.register_group("h", TENSORS, flatshard.SGD(lr=0.1)),
            "init_group": lambda: c.init_group("g", {"weight": np.ones((4, 3), np.float32),
                                                     "bias": np.ones(4, np.float32)}),
            "init_group_from_seed": lambda: c.init_group_from_seed("g", 7),
            "set_hyperparams": lambda: c.set_hyperparams("g", lr=0.2),
            "list_checkpoints": c.list_checkpoints,
            "delete_checkpoint": lambda: c.delete_checkpoint("none"),
            "status": c.status,
        }
        self.cluster.pause(0)  # each of them asks server 0 first: up to 60 s each
        try:
            for name, call in calls.items():
                with self.subTest(call=name):
                    self.assert_ctrl_c_ends(call, within=10.0)
        finally:
            self.cluster.resume(0)
        c.configure_job()  # the client serves on (a delete_job read before its stop may have gone through)
        c.register_group("g", TENSORS, flatshard.SGD(lr=0.1))
        self.assertEqual(c.version("g"), 0)
        self.assertEqual(len(c.status()["servers"]), 3)

    def test_dropping_a_waiting_transfer_or_its_client_does_not_wait_for_it(self):
        c = self.client(workers=2, job="dropped", timeout=60.0)  # worker 1 never sends
        c.configure_job()
        c.register_group("g", TENSORS, flatshard.SGD(lr=0.1))
        start = time.monotonic()
        pending = c.gather_async("g", min_version=1)
        del pending  # its buffer stays with the client until the gather ends
        gc.collect()
        self.assertLess(time.monotonic() - start, 30.0)
        pending = c.gather_async("g", min_version=1)
        del c
        gc.collect()
        self.assertLess(time.monotonic() - start, 30.0)
        with self.assertRaisesRegex(flatshard.CancelledError, "the client was destroyed with this transfer in flight"):
            pending.wait()

    def test_an_unknown_device_plane_is_refused(self):
        with self.assertRaisesRegex(flatshard.InvalidArgumentError, "device_plane 'gpu' is not one of"):
            self.client(device_plane="gpu")
        self.assertEqual(self.client(device_plane="tcp").data_planes(), ["tcp"] * 3)

    def test_transfer_options_split_a_gather_and_a_scatter_into_the_same_values(self):
        whole = self.client(job="split")
        split = self.client(job="split", max_in_flight=4, gather_split_bytes=256,
                            scatter_split_bytes=256)
        for c in (whole, split):
            c.configure_job()
            c.register_group("big", [("w", (3001,), "float32")], flatshard.SGD(lr=0.1))
        whole.init_group_from_seed("big", 5)
        expected = whole.gather("big")["w"]
        np.testing.assert_array_equal(split.gather("big")["w"], expected)
        np.testing.assert_array_equal(split.gather("big", dtype="float16")["w"],
                                      expected.astype(np.float16).astype(np.float32))
        # A gradient in parts steps the group as SGD does with it whole (one worker).
        grad = np.linspace(-1.0, 1.0, 3001, dtype=np.float32)
        split.scatter("big", {"w": grad}, step=0)
        np.testing.assert_array_equal(whole.gather("big", min_version=1)["w"],
                                      expected - np.float32(0.1) * grad)
        for bad in ({"max_in_flight": 0}, {"max_in_flight": 65}, {"gather_split_bytes": -1},
                    {"scatter_split_bytes": -1}, {"timeout": 0}):
            with self.assertRaises(flatshard.InvalidArgumentError):
                self.client(job="split", **bad)

    def test_many_groups_move_together_as_each_alone(self):
        many, one = self.client(job="together"), self.client(job="together-one")
        names = [f"g{k}" for k in range(20)] + ["large"]
        shapes = [(50 * k + 7,) for k in range(20)] + [(70001,)]  # "large": past a pipeline's part
        for c in (many, one):
            c.configure_job()
            c.register_groups([(n, [("w", s, "float32")], flatshard.SGD(lr=0.5)) for n, s in zip(names, shapes)])
            for k, n in enumerate(names):
                c.init_group_from_seed(n, 40 + k)
        gathered = [t.wait() for t in many.gather_many_async(names)]
        for n, (flat, version) in zip(names, gathered):
            self.assertEqual(version, 0)
            np.testing.assert_array_equal(flat, one.gather_flat(n)[0])
        grads = [np.sin(flat) for flat, _ in gathered]
        for t in many.scatter_many_async(names, grads, step=0):
            self.assertIsNone(t.wait())
        for n, grad in zip(names, grads):
            one.scatter(n, grad, step=0)
        outs = [torch.full((one.layout(n).padded_numel,), -1.0, dtype=torch.bfloat16) for n in names]
        for n, out, t in zip(names, outs, many.gather_many_async(names, 1, "bfloat16", outs)):
            got, version = t.wait()
            self.assertIs(got, out)
            self.assertEqual(version, 1)
            reference = torch.empty_like(out)
            one.gather_async(n, 1, "bfloat16", out=reference).wait()
            self.assertTrue(torch.equal(out, reference), n)
        with self.assertRaisesRegex(flatshard.InvalidArgumentError, "2 groups but 1 buffers"):
            many.scatter_many_async(names[:2], grads[:1], step=1)
        for pending in many._native.gather_many(names[:2], 0, "float32", [grads[0]]):  # past the check
            with self.assertRaisesRegex(flatshard.InvalidArgumentError, "2 groups but 1 buffers"):
                pending.wait()
        with self.assertRaises(flatshard.NotFoundError):
            many.gather_many_async(["g0", "nope"])

    def test_the_version_is_the_builds(self):
        root = os.path.join(os.path.dirname(__file__), "..", "..", "CMakeLists.txt")
        with open(root) as cmake:
            project = next(line for line in cmake if line.startswith("project(flatshard VERSION "))
        self.assertEqual(flatshard.__version__, project.split()[2])
        self.assertIsInstance(flatshard.PROTOCOL_REVISION, int)
        self.assertGreater(flatshard.PROTOCOL_REVISION, 0)

    def test_a_deleted_job_frees_its_groups_and_its_name(self):
        workers = [self.client(r, 2, job="finished") for r in range(2)]
        workers[0].configure_job()
        workers[0].register_group("g", TENSORS, flatshard.Adam(lr=1e-3))
        workers[0].init_group("g", values(3))
        waiting = {}

        def wait():  # worker 1 never sends: version 1 never comes
            try:
                workers[0].wait_version("g", 1)
            except flatshard.Error as e:
                waiting["error"] = e

        waiter = threading.Thread(target=wait)
        waiter.start()
        time.sleep(0.2)
        freed = workers[1].delete_job()
        waiter.join(timeout=10)
        self.assertFalse(waiter.is_alive(), "the wait ran on after the delete")
        self.assertIsInstance(waiting.get("error"), flatshard.NotFoundError)
        # Parameters, gradient, two Adam moments (4 x 16 floats over 3 servers: shards of 6).
        self.assertGreaterEqual(freed, 4 * 3 * 6 * 4)
        groups = [g for s in workers[0].status()["servers"] for g in s["groups"]]
        self.assertNotIn("finished", {g["job"] for g in groups})
        with self.assertRaises(flatshard.NotFoundError):
            workers[0].gather("g")
        with self.assertRaises(flatshard.NotFoundError):
            workers[1].delete_job()
        again = self.client(0, 1, job="finished")  # other settings under the same name
        again.configure_job(reduce="sum")
        again.register_group("g", TENSORS, flatshard.SGD(lr=0.1))
        self.assertEqual(again.version("g"), 0)

    def test_status_reports_every_server(self):
        c = self.client(job="status")
        status = c.status()
        self.assertEqual(len(status["servers"]), 3)
        self.assertEqual({s["rank"] for s in status["servers"]}, {0, 1, 2})
        # A CPU-tier server is reached over TCP; a device one from this GPU over CUDA IPC.
        self.assertEqual(c.data_planes(), ["cuda-ipc" if MEMORY == "device" else "tcp"] * 3)
        # Each server timed the calls of this client's handshake, by method.
        for server in status["servers"]:
            methods = {rpc["name"] for rpc in server["rpc_seconds"]}
            self.assertIn("flatshard.v1.Flatshard/OpenSession", methods)

    def test_register_groups_registers_many_in_order_and_names_a_refused_one(self):
        c = self.client(job="many")
        c.configure_job()
        sgd = flatshard.SGD(lr=0.1)
        layouts = c.register_groups([(f"g{i}", [("w", (i + 1,), "float32")], sgd) for i in range(5)]
                                    + [("aligned", TENSORS, flatshard.AdamW(), 8)])
        # The last: weight's 12 elements padded to 16 for align 8, then bias's 4.
        self.assertEqual([layout.unpadded_numel for layout in layouts], [1, 2, 3, 4, 5, 20])
        self.assertEqual(c.layout("g3").unpadded_numel, 4)
        self.assertEqual(c.version("g4"), 0)  # on the servers
        with self.assertRaisesRegex(flatshard.AlreadyExistsError, "group 'g2'"):
            c.register_groups([("g2", [("w", (9,), "float32")], sgd)])
        with self.assertRaisesRegex(flatshard.InvalidArgumentError, "group 'twice' is named twice"):
            c.register_groups([("twice", TENSORS, sgd), ("twice", TENSORS, sgd)])
        with self.assertRaises(flatshard.NotFoundError):
            c.version("twice")

    def test_init_groups_pushes_many_and_names_a_refused_one(self):
        c = self.client(job="pushed")
        c.configure_job()
        sgd = flatshard.SGD(lr=0.1)
        c.register_groups([(f"g{i}", [("w", (i + 1,), "float32")], sgd) for i in range(4)])
        values = {f"g{i}": {"w": np.arange(i + 1, dtype=np.float32) + 10 * i} for i in range(4)}
        c.init_groups(values.items())
        for name, tensors in values.items():
            np.testing.assert_array_equal(c.gather(name)["w"], tensors["w"])
        with self.assertRaisesRegex(flatshard.InvalidArgumentError, "init_group\\('g2'\\)"):
            c.init_groups([("g1", {"w": np.zeros(2, np.float32)}), ("g2", {"w": np.zeros(2, np.float32)})])
        np.testing.assert_array_equal(c.gather("g1")["w"], values["g1"]["w"])  # nothing was sent

    def test_status_without_groups_leaves_out_only_them(self):
        c = self.client(job="brief")
        c.configure_job()
        c.register_group("g", TENSORS, flatshard.SGD(lr=0.1))
        full, brief = c.status()["servers"], c.status(groups=False)["servers"]
        for whole, short in zip(full, brief):
            self.assertIn(("brief", "g"), {(g["job"], g["group"]) for g in whole["groups"]})
            self.assertEqual(short["groups"], [])
            self.assertEqual(short["rank"], whole["rank"])
            self.assertIn("brief", {job["job"] for job in short["jobs"]})
            # Each job's groups summed up by the server, with or without them.
            group = next(g for g in whole["groups"] if g["job"] == "brief")
            summary = next(j for j in short["jobs"] if j["job"] == "brief")["summary"]
            self.assertEqual(summary["groups"], 1)
            self.assertEqual(summary["bytes"], group["bytes"])

    def test_model_timeout_bounds_an_export_and_keepalive_has_a_floor(self):
        unbounded = self.client(job="bounded")  # the default: no model_timeout
        unbounded.configure_job()
        unbounded.register_group("g", TENSORS, flatshard.SGD(lr=0.1))
        bounded = self.client(job="bounded", model_timeout=1e-6)
        with tempfile.TemporaryDirectory() as out:
            with self.assertRaises(flatshard.DeadlineExceededError):
                bounded.export_state_dict(out, kind="full")
            unbounded.export_state_dict(out, kind="full")
            self.assertTrue(os.path.exists(os.path.join(out, "model.safetensors")))
        with self.assertRaisesRegex(flatshard.InvalidArgumentError, "keepalive 500ms is below 1s"):
            self.client(job="bounded", keepalive=0.5)
        with self.assertRaises(flatshard.InvalidArgumentError):
            self.client(job="bounded", model_timeout=0)


class ErrorTest(unittest.TestCase):
    def setUp(self):
        self.cluster = checked_cluster.LocalCluster(servers=2, memory=MEMORY).start()
        self.c = flatshard.Client(self.cluster.addresses, token=self.cluster.token, timeout=2.0)
        self.c.configure_job()
        self.c.register_group("g", TENSORS, flatshard.SGD(lr=0.1))

    def tearDown(self):
        self.cluster.close()

    def test_wrong_shape_and_dtype(self):
        bad_shape = {"weight": np.zeros((3, 4), np.float32), "bias": np.zeros(4, np.float32)}
        with self.assertRaises(flatshard.InvalidArgumentError) as e:
            self.c.scatter("g", bad_shape, step=0)
        self.assertIn("weight", str(e.exception))
        bad_dtype = {"weight": np.zeros((4, 3), np.float64), "bias": np.zeros(4, np.float64)}
        with self.assertRaises(flatshard.InvalidArgumentError):
            self.c.scatter("g", bad_dtype, step=0)
        with self.assertRaises(flatshard.InvalidArgumentError):
            self.c.gather("g", dtype="int8")
        misnamed = {"weight": np.zeros((4, 3), np.float32), "bais": np.zeros(4, np.float32)}
        with self.assertRaises(flatshard.InvalidArgumentError) as e:
            self.c.scatter("g", misnamed, step=0)
        self.assertIn("missing tensors ['bias'], unknown tensors ['bais']", str(e.exception))
        with self.assertRaises(flatshard.InvalidArgumentError) as e:
            self.c.register_group("h", [("w", (2,), "float32")], flatshard.SGD(lr=-1.0))
        self.assertEqual(e.exception.code, 3)

    def test_unknown_group_and_server_side_errors_carry_the_status_code(self):
        with self.assertRaises(flatshard.NotFoundError):
            self.c.gather("nope")
        zeros = {"weight": np.zeros((4, 3), np.float32), "bias": np.zeros(4, np.float32)}
        with self.assertRaises(flatshard.FailedPreconditionError) as e:
            self.c.scatter("g", zeros, step=5)  # a future step
        self.assertEqual(e.exception.code_name, "FAILED_PRECONDITION")
        self.assertIn("expected step 0", e.exception.message)
        with self.assertRaises(flatshard.AlreadyExistsError):
            self.c.register_group("g", [("other", (2,), "float32")], flatshard.SGD(lr=0.1))
        with self.assertRaises(flatshard.UnauthenticatedError):
            flatshard.Client(self.cluster.addresses, token="wrong")

    def test_a_dead_server_fails_promptly(self):
        self.cluster.kill(1)
        start = time.monotonic()
        with self.assertRaises((flatshard.UnavailableError, flatshard.DeadlineExceededError)):
            self.c.gather("g")
        self.assertLess(time.monotonic() - start, 10.0)

    def test_gather_of_a_future_version_times_out(self):
        start = time.monotonic()
        with self.assertRaises(flatshard.DeadlineExceededError):
            self.c.gather("g", min_version=3)
        self.assertLess(time.monotonic() - start, 10.0)


class LocalClusterTest(unittest.TestCase):
    def test_server_log_levels_that_keep_the_start_up_line(self):
        for hiding in (["--log_level=warning"], ["--log_level=error"], ["--log_file=/tmp/x.log"]):
            with self.assertRaises(ValueError):
                checked_cluster.LocalCluster(servers=1, server_args=hiding)
        with checked_cluster.LocalCluster(servers=1, server_args=["--log_level=debug"]) as cluster:
            flatshard.Client(cluster.addresses, token=cluster.token).configure_job()
            deadline = time.monotonic() + 10
            while "ConfigureJob" not in cluster.server_log(0) and time.monotonic() < deadline:
                time.sleep(0.05)
            log = cluster.server_log(0)
        self.assertIn(" rank 0 info: job 'default' configured: workers 1", log)
        self.assertIn(" rank 0 debug: rpc /flatshard.v1.Flatshard/ConfigureJob from ", log)

    def test_a_port_taken_before_the_server_binds_it_starts_the_cluster_elsewhere(self):
        from flatshard import local_cluster
        taken = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        picks = []
        real = local_cluster._free_ports

        def first_pick_taken(count):
            ports = real(count)
            if not picks:
                ports[0] = taken.getsockname()[1]  # server 0's control port
            picks.append(ports)
            return ports

        local_cluster._free_ports = first_pick_taken
        try:
            with checked_cluster.LocalCluster(servers=2) as cluster:
                self.assertEqual(len(picks), 2)
                self.assertEqual(cluster.addresses[0], f"127.0.0.1:{picks[1][0]}")
                c = flatshard.Client(cluster.addresses, token=cluster.token, timeout=5.0)
                self.assertEqual(len(c.status()["servers"]), 2)
        finally:
            local_cluster._free_ports = real
            taken.close()


class TlsTest(unittest.TestCase):
    """Servers started with --tls_cert_file: the Python client connects with tls_ca_file,
    trains a clipped step (the servers exchange the norm over TLS) and reads the status;
    a plaintext client is refused. With --tls_client_ca_file, a client presents
    tls_cert_file (ShardedModule's own clients too), and one without is refused."""

    def setUp(self):
        self.dir = tempfile.TemporaryDirectory()
        key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes"]
        run = lambda *args: subprocess.run(["openssl", *args], cwd=self.dir.name, check=True,
                                           capture_output=True)
        run("req", "-x509", *key, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
            "-subj", "/CN=flatshard-test-ca")
        run("req", *key, "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=127.0.0.1")
        with open(os.path.join(self.dir.name, "san.cnf"), "w") as f:
            f.write("subjectAltName=IP:127.0.0.1\n")
        run("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
            "-CAcreateserial", "-days", "2", "-extfile", "san.cnf", "-out", "server.pem")
        # A client certificate for mutual TLS.
        run("req", *key, "-keyout", "client.key", "-out", "client.csr", "-subj", "/CN=worker")
        run("x509", "-req", "-in", "client.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
            "-CAcreateserial", "-days", "2", "-out", "client.pem")
        self.ca = os.path.join(self.dir.name, "ca.pem")
        self.cluster = checked_cluster.LocalCluster(servers=2, server_args=[
            f"--tls_cert_file={self.dir.name}/server.pem", f"--tls_key_file={self.dir.name}/server.key",
            f"--tls_ca_file={self.ca}"]).start()

    def tearDown(self):
        self.cluster.close()
        self.dir.cleanup()

    def test_clipped_step_and_status_over_tls(self):
        c = flatshard.Client(self.cluster.addresses, token=self.cluster.token, tls_ca_file=self.ca)
        c.configure_job(max_grad_norm=1.0)
        c.register_group("g", TENSORS, flatshard.SGD(lr=1.0))
        init = values(2)
        c.init_group("g", init)
        grads = values(3)
        c.scatter("g", grads, step=0)
        params = c.gather("g", min_version=1)
        norm = np.sqrt(sum(np.sum(g.astype(np.float64) ** 2) for g in grads.values()))
        coef = min(1.0, 1.0 / (norm + 1e-6))
        for name in ("weight", "bias"):
            np.testing.assert_allclose(params[name], init[name] - coef * grads[name].astype(np.float64),
                                       rtol=1e-5, atol=1e-6)
        status = c.status()["servers"]
        self.assertEqual(len(status), 2)
        self.assertTrue(all(s["tls"] and int(s["tls_expiry_unix_seconds"]) > time.time() for s in status))
        once = flatshard.Client(self.cluster.addresses, token=self.cluster.token, tls_ca_file=self.ca,
                                tls_reload_interval=0)
        self.assertEqual(once.version("g"), 1)
        with self.assertRaisesRegex(flatshard.InvalidArgumentError, "tls_ca_file=.*holds no PEM certificate"):
            flatshard.Client(self.cluster.addresses, token=self.cluster.token,
                             tls_ca_file=os.path.join(self.dir.name, "server.csr"))
        with self.assertRaisesRegex(flatshard.UnavailableError, "needs tls_ca_file"):
            flatshard.Client(self.cluster.addresses, token=self.cluster.token, timeout=5.0)

    def test_mutual_tls(self):
        import flatshard.torch
        d = self.dir.name
        with checked_cluster.LocalCluster(servers=2, server_args=[
                f"--tls_cert_file={d}/server.pem", f"--tls_key_file={d}/server.key",
                f"--tls_ca_file={self.ca}", f"--tls_client_ca_file={self.ca}",
                "--tls_data_plane"]) as cluster:
            c = flatshard.Client(cluster.addresses, token=cluster.token, tls_ca_file=self.ca,
                                 tls_cert_file=f"{d}/client.pem", tls_key_file=f"{d}/client.key")
            c.configure_job()
            # The data plane speaks TLS too: the state dict below crosses it.
            self.assertTrue(all(s["tls_client_certificates"] and s["data_tls"] for s in c.status()["servers"]))
            # ShardedModule's start-up barrier is a client of its own: it presents the
            # same certificate.
            linear = torch.nn.Linear(4, 3)
            expected = {k: v.detach().clone() for k, v in linear.state_dict().items()}
            model = flatshard.torch.ShardedModule(linear, c, flatshard.SGD(lr=0.1))
            state = model.state_dict()
            self.assertEqual(sorted(state), ["bias", "weight"])
            for name, value in expected.items():
                torch.testing.assert_close(state[name], value, rtol=0, atol=0)
            self.assertGreater(model.delete_job(), 0)
            with self.assertRaisesRegex(flatshard.UnavailableError, "presents no client certificate"):
                flatshard.Client(cluster.addresses, token=cluster.token, tls_ca_file=self.ca,
                                 timeout=5.0)
            with self.assertRaisesRegex(flatshard.InvalidArgumentError, "go together"):
                flatshard.Client(cluster.addresses, token=cluster.token, tls_ca_file=self.ca,
                                 tls_cert_file=f"{d}/client.pem")


if __name__ == "__main__":
    unittest.main()
