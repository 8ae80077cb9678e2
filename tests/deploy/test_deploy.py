"""The deployment files against the server they start: every flag they pass is one the
built flatshard-server defines (a renamed flag would otherwise break deployments
silently), the Kubernetes StatefulSet renders, pod by pod, a consistent server
command line: its rank is its ordinal, its --listen is its own entry of --cluster, the
cluster list has one entry per replica that the headless Service resolves, and the files
it names are where the volumes are mounted; and the Docker images (CPU and CUDA) install
every shared library the binaries they copy load (a library linked later, and not added
there, would otherwise stop the image's server at start), the CUDA one with one CUDA
version throughout and the NCCL the server loads.

Environment: FLATSHARD_SERVER_PATH (the built server), FLATSHARD_SOURCE_DIR.
"""

import os
import re
import shlex
import subprocess
import unittest

import yaml

SOURCE = os.environ["FLATSHARD_SOURCE_DIR"]
SERVER = os.environ["FLATSHARD_SERVER_PATH"]


def server_flags():
    help_text = subprocess.run([SERVER, "--help"], capture_output=True, text=True, check=True).stdout
    return set(re.findall(r"^\s+--([a-z_]+) \(", help_text, re.MULTILINE))


def flags_of(arguments):
    """{name: value} of the --name=value arguments."""
    flags = {}
    for argument in arguments:
        if argument.startswith("--"):
            name, _, value = argument[2:].partition("=")
            flags[name] = value
    return flags


def owning_packages(paths):
    """{path: the Debian package that installed it} for those of `paths` that one did, in
    one dpkg-query (each call reads every package's file list: a call per library took
    over a minute). dpkg records a library under /lib or /usr/lib (merged on Debian 12),
    whichever its package ships."""
    candidates = {}
    for path in paths:
        for candidate in {path, path.removeprefix("/usr"), "/usr" + path}:
            candidates.setdefault(candidate, path)
    # Exits 1 when some pattern matches nothing; the others are still listed.
    listing = subprocess.run(["dpkg-query", "-S", *sorted(candidates)], capture_output=True, text=True).stdout
    owners = {}
    for line in listing.splitlines():
        if line.startswith("diversion "):
            continue
        package, _, found = line.partition(": ")
        if found in candidates:
            owners[candidates[found]] = package.split(",")[0].split(":")[0]
    return owners


def installed_with(packages):
    """`packages` and what they depend on (Depends, Pre-Depends; of alternatives, the
    first, which apt picks), as installed here (a package dpkg does not know here adds
    nothing: no library the binaries load here can come from it)."""
    listing = subprocess.run(["dpkg-query", "-W", "-f=${Package}\t${Depends}, ${Pre-Depends}\n"],
                             capture_output=True, text=True, check=True).stdout
    depends = {}
    for line in listing.splitlines():
        package, _, fields = line.partition("\t")
        names = [dependency.split("|")[0].strip().split(" ")[0].split(":")[0] for dependency in fields.split(",")]
        depends.setdefault(package, []).extend(name for name in names if name)
    seen, todo = set(), list(packages)
    while todo:
        package = todo.pop()
        if package in seen:
            continue
        seen.add(package)
        todo.extend(depends.get(package, []))
    return seen


def base_image_packages():
    """What debian:12 holds before the Dockerfile installs anything: the packages of
    priority required, and apt."""
    listing = subprocess.run(["dpkg-query", "-W", "-f=${Package} ${Priority}\n"],
                             capture_output=True, text=True, check=True).stdout
    return [line.split()[0] for line in listing.splitlines() if line.endswith(" required")] + ["apt"]


class DeployTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.known = server_flags()
        assert {"listen", "rank", "cluster"} <= cls.known, cls.known

    def test_systemd_unit_passes_only_flags_the_server_defines(self):
        with open(os.path.join(SOURCE, "deploy", "flatshard-server.service")) as unit:
            text = unit.read()
        exec_start = re.search(r"^ExecStart=(.*?)(?<!\\)$", text, re.MULTILINE | re.DOTALL).group(1)
        arguments = shlex.split(exec_start.replace("\\\n", " "))
        self.assertEqual(arguments[0], "/usr/local/bin/flatshard-server")
        flags = flags_of(arguments[1:])
        self.assertLessEqual(set(flags), self.known)
        self.assertIn("auth_token_file", flags)

    def test_statefulset_renders_a_consistent_command_line_per_pod(self):
        with open(os.path.join(SOURCE, "deploy", "kubernetes", "flatshard.yaml")) as manifest:
            documents = {d["kind"]: d for d in yaml.safe_load_all(manifest)}
        service, statefulset = documents["Service"], documents["StatefulSet"]
        self.assertEqual(service["spec"]["clusterIP"], "None")
        self.assertTrue(service["spec"]["publishNotReadyAddresses"])
        ports = {p["name"]: p["port"] for p in service["spec"]["ports"]}
        spec = statefulset["spec"]
        self.assertEqual(spec["serviceName"], service["metadata"]["name"])
        self.assertEqual(service["spec"]["selector"], spec["selector"]["matchLabels"])
        pod = spec["template"]["spec"]
        container = pod["containers"][0]
        self.assertEqual({p["name"]: p["containerPort"] for p in container["ports"]}, ports)
        env = {e["name"]: e["value"] for e in container["env"]}
        mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
        replicas = spec["replicas"]
        cluster = env["FLATSHARD_CLUSTER"].split(",")
        self.assertEqual(cluster, [f"{statefulset['metadata']['name']}-{i}.{spec['serviceName']}:{ports['control']}"
                                   for i in range(replicas)])
        self.assertEqual(container["command"], ["/bin/sh", "-c"])
        script = container["args"][0]
        self.assertTrue(script.startswith("exec /usr/local/bin/flatshard-server "), script)
        for ordinal in range(replicas):
            hostname = f"{statefulset['metadata']['name']}-{ordinal}"
            # The shell the pod runs, with the server replaced by a printer of its argv.
            rendered = subprocess.run(
                ["/bin/sh", "-c", script.replace("exec /usr/local/bin/flatshard-server",
                                                  "exec printf '%s\\n'", 1)],
                env={**env, "HOSTNAME": hostname, "PATH": "/usr/bin:/bin"},
                capture_output=True, text=True, check=True).stdout.splitlines()
            flags = flags_of(rendered)
            self.assertLessEqual(set(flags), self.known, hostname)
            self.assertEqual(int(flags["rank"]), ordinal)
            self.assertEqual(flags["cluster"].split(","), cluster)
            self.assertEqual(flags["listen"], cluster[ordinal])
            self.assertEqual(flags["data_listen"], f"{hostname}.{spec['serviceName']}:{ports['data']}")
            self.assertEqual(flags["metrics_listen"], f"{hostname}.{spec['serviceName']}:{ports['metrics']}")
            self.assertEqual(os.path.dirname(flags["auth_token_file"]), mounts["token"])
            self.assertEqual(os.path.dirname(flags["metrics_token_file"]), mounts["token"])
            self.assertNotEqual(flags["metrics_token_file"], flags["auth_token_file"])
            self.assertEqual(flags["checkpoint_root"], mounts["checkpoints"])
        volumes = {v["name"]: v for v in pod["volumes"]}
        self.assertEqual(volumes["token"]["secret"]["secretName"], "flatshard-token")
        self.assertEqual([t["metadata"]["name"] for t in spec["volumeClaimTemplates"]], ["checkpoints"])

    def runtime_stage(self, name):
        """The last stage of docker/`name` (the image): its text, the packages it installs
        beside docker/runtime-packages, and the CUDA runtime's version ("13.0") where
        those name one. Checks that it installs the runtime packages and copies both
        binaries."""
        with open(os.path.join(SOURCE, "docker", name)) as dockerfile:
            runtime = dockerfile.read().rsplit("\nFROM ", 1)[1]
        self.assertIn("COPY docker/runtime-packages /tmp/\n", runtime, name)
        extra = re.search(r"xargs apt-get install ([^<]*)< /tmp/runtime-packages", runtime).group(1)
        extra = [word for word in extra.split() if not word.startswith("-")]
        copied = re.search(r"^COPY --from=build (.*) /usr/local/bin/$", runtime, re.MULTILINE).group(1).split()
        self.assertEqual([os.path.basename(path) for path in copied], ["flatshard-server", "flatshard"], name)
        self.assertIn('RUN ! ldd /usr/local/bin/flatshard-server /usr/local/bin/flatshard | grep "not found"',
                      runtime, name)
        # The build stage configures build/ afresh: a build tree of this checkout must not
        # be copied in (its CMakeCache.txt names this machine's paths).
        with open(os.path.join(SOURCE, ".dockerignore")) as ignore:
            ignored = ignore.read().split()
        self.assertLessEqual({"build", "build-*", ".devcarry"}, set(ignored))
        cudart = [re.fullmatch(r"cuda-cudart-(\d+)-(\d+)", word) for word in extra]
        versions = [f"{m.group(1)}.{m.group(2)}" for m in cudart if m]
        return runtime, extra, versions[0] if versions else None

    def assert_image_has_every_library(self, name, extra, cuda_version):
        """Every shared library the two binaries built here load comes from a Debian
        package the image installs (docker/runtime-packages and `extra`, with what they
        depend on), or is the CUDA runtime of the image's `cuda_version` (None: the image
        has no CUDA, and the binaries built here may not load it)."""
        with open(os.path.join(SOURCE, "docker", "runtime-packages")) as listing:
            packages = listing.read().split()
        available = installed_with(packages + extra + base_image_packages())
        for binary in (SERVER, os.path.join(os.path.dirname(SERVER), "flatshard")):
            loaded = subprocess.run(["ldd", binary], capture_output=True, text=True, check=True).stdout
            self.assertNotIn("not found", loaded, binary)
            paths = re.findall(r"=> (/\S+)", loaded)
            owners = owning_packages(path for path in paths if not path.startswith("/usr/local/cuda"))
            for path in paths:
                if path.startswith("/usr/local/cuda"):
                    if cuda_version is None:
                        continue  # the CUDA runtime of a CUDA build; this image is built without CUDA
                    toolkit = re.search(r"/cuda-(\d+\.\d+)/", os.path.realpath(path))
                    self.assertIsNotNone(toolkit, f"{binary} loads {path} from no versioned CUDA toolkit")
                    self.assertEqual(toolkit.group(1), cuda_version, f"{name} installs another CUDA runtime")
                    self.assertRegex(os.path.basename(path), r"^libcudart\.so\.\d+$",
                                     f"{binary} loads {path}, which {name} lacks")
                    continue
                package = owners.get(path)
                self.assertIsNotNone(package, f"{binary} loads {path}, which no Debian package installed")
                self.assertTrue(package in available, f"{binary} loads {path} from {package}, which {name} lacks")

    def test_cpu_image_installs_every_library_its_binaries_load(self):
        runtime, extra, cuda_version = self.runtime_stage("Dockerfile.cpu")
        self.assertEqual((extra, cuda_version), ([], None))
        self.assertNotIn("cuda", runtime.lower())
        self.assert_image_has_every_library("Dockerfile.cpu", extra, None)

    def test_cuda_image_installs_every_library_its_binaries_load_and_nccl(self):
        runtime, extra, cuda_version = self.runtime_stage("Dockerfile.cuda")
        self.assertIsNotNone(cuda_version, "Dockerfile.cuda installs no cuda-cudart-X-Y")
        with open(os.path.join(SOURCE, "docker", "Dockerfile.cuda")) as dockerfile:
            build = dockerfile.read().rsplit("\nFROM ", 1)[0]
        # One CUDA version throughout: the compiler, the headers the build links, the
        # runtime the image installs and the directory the loader is told of.
        dashed = cuda_version.replace(".", "-")
        self.assertIn(f"-DCMAKE_CUDA_COMPILER=/usr/local/cuda-{cuda_version}/bin/nvcc", build)
        self.assertIn(f"cuda-nvcc-{dashed} cuda-cudart-dev-{dashed}", build)
        self.assertIn(f"/usr/local/cuda-{cuda_version}/targets/x86_64-linux/lib", runtime)
        self.assertIn("-DFLATSHARD_CUDA=ON", build)
        # NCCL is loaded at run time by the name kernels/cuda/nccl.cc asks for.
        with open(os.path.join(SOURCE, "kernels", "cuda", "nccl.cc")) as source:
            self.assertIn('"libnccl.so.2"', source.read())
        self.assertIn("libnccl2", extra)
        self.assertIn("libnccl-dev", build)
        self.assert_image_has_every_library("Dockerfile.cuda", extra, cuda_version)

if __name__ == "__main__":
    unittest.main()
