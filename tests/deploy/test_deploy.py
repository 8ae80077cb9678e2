"""The deployment files against the server they start: every flag they pass is one the
built flatshard-server defines (a renamed flag would otherwise break deployments
silently), the Kubernetes StatefulSet renders, pod by pod, a consistent server
command line: its rank is its ordinal, its --listen is its own entry of --cluster, the
cluster list has one entry per replica that the headless Service resolves, and the files
it names are where the volumes are mounted; and the Docker image installs every shared
library the binaries it copies load (a library linked later, and not added there, would
otherwise stop the image's server at start).

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


def owning_package(path):
    """The Debian package that installed `path`, or None. dpkg records a library under
    /lib or /usr/lib (merged on Debian 12), whichever its package ships."""
    for candidate in {path, path.removeprefix("/usr"), "/usr" + path}:
        found = subprocess.run(["dpkg-query", "-S", candidate], capture_output=True, text=True)
        if found.returncode == 0:
            return found.stdout.split(":", 1)[0]
    return None


def installed_with(packages):
    """`packages` and what they depend on (Depends, Pre-Depends; of alternatives, the
    first, which apt picks), as installed here (a package dpkg does not know here adds
    nothing: no library the binaries load here can come from it)."""
    seen, todo = set(), list(packages)
    while todo:
        package = todo.pop()
        if package in seen:
            continue
        seen.add(package)
        fields = subprocess.run(["dpkg-query", "-W", "-f=${Depends}, ${Pre-Depends}", package],
                                capture_output=True, text=True).stdout
        for dependency in fields.split(","):
            name = dependency.split("|")[0].strip().split(" ")[0].split(":")[0]
            if name:
                todo.append(name)
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

    def test_docker_image_installs_every_library_its_binaries_load(self):
        with open(os.path.join(SOURCE, "docker", "Dockerfile.cpu")) as dockerfile:
            runtime = dockerfile.read().rsplit("\nFROM ", 1)[1]  # the last stage: the image
        install = re.search(r"apt-get install ((?:[^&\\]|\\\n)*)", runtime).group(1)
        listed = [word for word in install.replace("\\\n", " ").split() if not word.startswith("-")]
        copied = re.search(r"^COPY --from=build (.*) /usr/local/bin/$", runtime, re.MULTILINE).group(1).split()
        self.assertEqual([os.path.basename(path) for path in copied], ["flatshard-server", "flatshard"])
        available = installed_with(listed + base_image_packages())
        for binary in (SERVER, os.path.join(os.path.dirname(SERVER), "flatshard")):
            loaded = subprocess.run(["ldd", binary], capture_output=True, text=True, check=True).stdout
            self.assertNotIn("not found", loaded, binary)
            for path in re.findall(r"=> (/\S+)", loaded):
                if path.startswith("/usr/local/cuda"):
                    continue  # the CUDA runtime of a CUDA build; the image is built without CUDA
                package = owning_package(path)
                self.assertIsNotNone(package, f"{binary} loads {path}, which no Debian package installed")
                self.assertTrue(package in available, f"{binary} loads {path} from {package}, which the image lacks")


if __name__ == "__main__":
    unittest.main()
