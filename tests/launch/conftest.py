"""Fixtures of the launch tier: a training config, a two-node SLURM cluster and two plain nodes, as network namespaces.

The system tests need root, slurm-wlm, munge, iproute2 and util-linux (scripts/install_system_deps.sh
installs them). When something is missing they fail and say what, rather than pass;
PHALANX_SKIP_SYSTEM_TESTS=1 turns that into a visible skip on machines that cannot have them.
"""

from __future__ import annotations

import io
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from helpers import built_once, descendants, write_chat_jsonl

# One config for every run of the tier, so each can be compared with the same uninterrupted run.
# Checkpoints every 3 steps give the elastic and preemption tests something to resume from.
MAX_STEPS = 9
SAVE_STEPS = 3


def system_requirement(missing: str) -> None:
    """Fail (or, when the machine is declared unable, skip) with the reason a system test cannot run."""
    message = f"{missing}; run scripts/install_system_deps.sh as root (or set PHALANX_SKIP_SYSTEM_TESTS=1 to skip)"
    if os.environ.get("PHALANX_SKIP_SYSTEM_TESTS") == "1":
        pytest.skip(message)
    pytest.fail(message, pytrace=False)


def need_root_and(*tools: str) -> None:
    if os.geteuid() != 0:
        system_requirement("this test needs root (network namespaces, SLURM daemons)")
    for tool in tools:
        if shutil.which(tool) is None:
            system_requirement(f"`{tool}` is not installed")


@pytest.fixture
def sbatch() -> str:
    """SLURM's sbatch, for a test that only parses a script with it (no daemon)."""
    found = shutil.which("sbatch")
    if found is None:
        system_requirement("`sbatch` is not installed")
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def local_env(**extra: str) -> dict[str, str]:
    """Environment for ranks on this machine: rendezvous and gloo stay on loopback."""
    return {**os.environ, "PYTHONUNBUFFERED": "1", "GLOO_SOCKET_IFNAME": "lo", **extra}


@pytest.fixture(scope="session")
def project(tmp_path_factory) -> Path:
    """A project folder: data, a training YAML, and room for the generated scripts."""
    root = tmp_path_factory.mktemp("launch-project")
    write_chat_jsonl(root / "data" / "train.jsonl", 48)
    config = {
        "output_dir": "runs/default",
        "data": {"dataset_path": "data/train.jsonl", "test_size": 0, "max_length": 768},
        "lora": {"r": 4, "dropout": 0.0},
        "training": {"max_steps": MAX_STEPS, "batch_size": 2, "learning_rate": 1.0e-2, "mixed_precision": "no"},
        "eval": {"eval_steps": 100},
        "checkpoint": {"save_steps": SAVE_STEPS},
        "logging": {"log_steps": 1, "progress_bar": False, "tensorboard": False, "loss_curve": False},
    }
    (root / "train.yaml").write_text(yaml.safe_dump(config))
    return root


def run_cli(project: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "phalanx", *args],
        cwd=project,
        env=local_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="session")
def generate(project):
    """generate('launcher', ...) runs the CLI in the project folder, in this process (no second start-up), and
    asserts it succeeded. The scripts it writes are then run for real."""
    from phalanx.cli import main

    def _generate(*args: str) -> str:
        out, err = io.StringIO(), io.StringIO()
        cwd = os.getcwd()
        os.chdir(project)
        try:
            with redirect_stdout(out), redirect_stderr(err):
                code = main(list(args))
        finally:
            os.chdir(cwd)
        assert code == 0, out.getvalue() + err.getvalue()
        return out.getvalue()

    return _generate


def losses_by_step(output_dir: Path) -> dict[int, float]:
    """The last logged loss of each step (a resumed run logs the steps after its checkpoint again)."""
    import json

    out: dict[int, float] = {}
    for line in (output_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record["kind"] == "train":
            out[record["step"]] = record["loss"]
    return out


def read_info(output_dir: Path) -> dict:
    import json

    return json.loads((output_dir / "final_training_info.json").read_text())


def kill_tree(proc: subprocess.Popen) -> None:
    for pid in [proc.pid, *descendants(proc.pid)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def run_bounded(cmd: list[str], cwd: Path, env: dict, timeout: float) -> subprocess.CompletedProcess:
    """subprocess.run, but a timeout also kills the ranks the command started, and reports its output."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc)
        out, err = proc.communicate()
        pytest.fail(
            f"{' '.join(cmd)} did not finish within {timeout:.0f} s:\n{out[-2000:]}\n{err[-3000:]}", pytrace=False
        )
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


@pytest.fixture(scope="session")
def reference_run_dir(project, generate, tmp_path_factory) -> Path:
    """The uninterrupted single-node run every other run is compared with: the generated script, executed once per
    session by the first worker that asks (helpers.built_once). The folder holds the script and its .bat twin
    (scripts/) and the run's output_dir (run/).

    Generated for 1 rank and started as `bash run_training.sh 2` (seed 000's launch_distributed.sh N),
    so the run also proves the process-count argument and the extra train flags reach torchrun.
    """

    def run(folder: Path) -> None:
        generate(
            "launcher",
            "--config",
            "train.yaml",
            "--num_gpus_per_node",
            "0",
            "--nproc_per_node",
            "1",
            "--master_port",
            str(free_port()),
            "--output",
            "scripts/run_training.sh",
        )
        shutil.copytree(project / "scripts", folder / "scripts")
        proc = run_bounded(
            ["bash", "scripts/run_training.sh", "2", "--output_dir", str(folder / "run")], project, local_env(), 240
        )
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    return built_once(tmp_path_factory, "launch-reference-run", run)


@pytest.fixture(scope="session")
def reference_run(reference_run_dir) -> dict[int, float]:
    """The reference run's loss of each step."""
    info = read_info(reference_run_dir / "run")
    assert info["world_size"] == 2 and info["global_step"] == MAX_STEPS
    losses = losses_by_step(reference_run_dir / "run")
    assert sorted(losses) == list(range(1, MAX_STEPS + 1))
    return losses


@pytest.fixture(scope="session")
def support():
    """The tier's helpers for test modules (test modules do not import conftest)."""
    return SimpleNamespace(
        MAX_STEPS=MAX_STEPS,
        SAVE_STEPS=SAVE_STEPS,
        free_port=free_port,
        local_env=local_env,
        losses_by_step=losses_by_step,
        read_info=read_info,
        run_cli=run_cli,
        run_bounded=run_bounded,
        kill_tree=kill_tree,
        system_requirement=system_requirement,
    )


# --- machines as network namespaces ----------------------------------------------------------------


@dataclass
class NodePair:
    """Two 'machines' on this one: network namespaces joined by a veth pair, each end named `ifname`."""

    namespaces: list[str]
    addresses: list[str]
    ifname: str

    def popen(self, node: int, cmd: list[str], **kwargs) -> subprocess.Popen:
        return subprocess.Popen(["ip", "netns", "exec", self.namespaces[node], *cmd], **kwargs)

    def enter(self, node: int) -> list[str]:
        """Command prefix that runs in this node's network, nothing else changed (`ip netns exec` also remounts
        /sys, which hides the cgroup tree slurmd needs)."""
        return ["nsenter", f"--net=/var/run/netns/{self.namespaces[node]}"]

    def remove(self) -> None:
        for ns in self.namespaces:
            # Anything still running inside was started by the test; the namespace cannot go while it runs.
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def sh(*cmd: str) -> None:
    subprocess.run(list(cmd), check=True, capture_output=True, text=True, timeout=20)


def linked_namespaces(tag: str, subnet: str) -> NodePair:
    """Create two namespaces `{tag}n0`/`{tag}n1` with addresses {subnet}.1 and {subnet}.2 on interface phx0."""
    need_root_and("ip", "nsenter", "unshare")
    names = [f"{tag}n0", f"{tag}n1"]
    pair = NodePair(names, [f"{subnet}.1", f"{subnet}.2"], "phx0")
    try:
        for ns in names:
            sh("ip", "netns", "add", ns)
        a, b = f"{tag}a", f"{tag}b"
        sh("ip", "link", "add", a, "type", "veth", "peer", "name", b)
        for ns, end, addr in zip(names, (a, b), pair.addresses):
            sh("ip", "link", "set", end, "netns", ns)
            sh("ip", "-n", ns, "link", "set", end, "name", pair.ifname)
            sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", pair.ifname)
            sh("ip", "-n", ns, "link", "set", pair.ifname, "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")
    except subprocess.CalledProcessError as exc:
        pair.remove()
        system_requirement(f"cannot create network namespaces: {' '.join(exc.cmd)}: {exc.stderr.strip()}")
    return pair


@pytest.fixture
def node_pair():
    """Two 'machines': 10.77.0.1 and 10.77.0.2 on interface phx0."""
    pair = linked_namespaces(f"phx{os.getpid() % 100000}", "10.77.0")
    yield pair
    pair.remove()


# --- SLURM ---------------------------------------------------------------------------------------


@dataclass
class SlurmCluster:
    """A two-node SLURM cluster on this machine, private to one test session (own ports, socket, configs).

    Each node is a network namespace with its own address and host name (its own UTS and mount namespaces, with
    a hosts file naming both nodes): slurmctld and slurmd run on node 0, a second slurmd on node 1. munged is
    shared through its socket file. Jobs see two machines: srun places one task on each, and ranks on different
    nodes talk over the veth pair as they would over a network.
    """

    root: Path
    nodes: NodePair
    names: list[str]
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        # No GLOO_SOCKET_IFNAME=lo: ranks on two nodes must use the node's interface (the script picks it).
        return {**{k: v for k, v in local_env().items() if k != "GLOO_SOCKET_IFNAME"}, "SLURM_CONF": str(self.conf)}

    def logs(self) -> str:
        parts = []
        for path in sorted((self.root / "log").glob("*")):
            parts.append(
                f"--- {path.name} (last lines)\n" + "\n".join(path.read_text(errors="replace").splitlines()[-15:])
            )
        return "\n".join(parts)

    def start(self) -> None:
        if (os.cpu_count() or 1) < 2:
            system_requirement("the SLURM tests run 2 CPU ranks and this machine has 1 core")
        for d in ("munge", "state", "log", *(f"spool/{name}" for name in self.names)):
            (self.root / d).mkdir(parents=True, exist_ok=True)
        (self.root / "munge").chmod(0o700)
        key = self.root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        socket_path = self.root / "munge" / "munge.socket"
        self.spawn(
            "munged",
            [
                "munged",
                "--foreground",
                "--force",
                f"--key-file={key}",
                f"--socket={socket_path}",
                f"--log-file={self.root / 'log' / 'munged.log'}",
                f"--pid-file={self.root / 'munge' / 'pid'}",
                f"--seed-file={self.root / 'munge' / 'seed'}",
            ],
        )
        self.wait_for(lambda: socket_path.exists(), 15, "munged did not create its socket")
        hosts = self.root / "hosts"
        hosts.write_text(
            "127.0.0.1 localhost\n" + "".join(f"{a} {n}\n" for a, n in zip(self.nodes.addresses, self.names))
        )
        # Each namespace has its own ports: both nodes use the same ones.
        ctld_port, d_port = free_port(), free_port()
        cpus = os.cpu_count()
        self.conf.write_text(
            "\n".join(
                [
                    "ClusterName=phalanxtest",
                    f"SlurmctldHost={self.names[0]}({self.nodes.addresses[0]})",
                    f"SlurmctldPort={ctld_port}",
                    f"SlurmdPort={d_port}",
                    "SlurmUser=root",
                    "SlurmdUser=root",
                    "AuthType=auth/munge",
                    "CredType=cred/munge",
                    # cred_expire also sets how long a requeued job waits before it may start again (default 120 s).
                    f"AuthInfo=socket={socket_path},cred_expire=5",
                    f"StateSaveLocation={self.root / 'state'}",
                    f"SlurmdSpoolDir={self.root / 'spool' / '%n'}",
                    f"SlurmctldPidFile={self.root / 'slurmctld.pid'}",
                    f"SlurmdPidFile={self.root / 'slurmd-%n.pid'}",
                    f"SlurmctldLogFile={self.root / 'log' / 'slurmctld.log'}",
                    f"SlurmdLogFile={self.root / 'log' / 'slurmd-%n.log'}",
                    "ProctrackType=proctrack/linuxproc",
                    "TaskPlugin=task/none",
                    "JobAcctGatherType=jobacct_gather/none",
                    "AccountingStorageType=accounting_storage/none",
                    "JobCompType=jobcomp/none",
                    "MpiDefault=none",
                    "MailProg=/bin/true",
                    "SchedulerType=sched/builtin",
                    "SchedulerParameters=sched_interval=2",  # start a requeued job soon after it becomes eligible
                    "SelectType=select/cons_tres",
                    "SelectTypeParameters=CR_CPU",
                    "ReturnToService=2",
                    "KillWait=10",
                    "SlurmdParameters=config_overrides",
                    # The nodes share this machine's cores: each offers all of them, as a real node would offer its own.
                    *(
                        f"NodeName={n} NodeAddr={a} NodeHostname={n} CPUs={cpus} RealMemory=2000 State=UNKNOWN"
                        for n, a in zip(self.names, self.nodes.addresses)
                    ),
                    f"PartitionName=test Nodes={','.join(self.names)} Default=YES MaxTime=INFINITE State=UP",
                ]
            )
            + "\n"
        )
        self.spawn("slurmctld", self.on_node(0, "slurmctld", "-D", "-f", str(self.conf)))
        for i, name in enumerate(self.names):
            self.spawn(f"slurmd-{name}", self.on_node(i, "slurmd", "-D", "-f", str(self.conf)))
        self.wait_for(lambda: self.sinfo_states() == ["idle"] * len(self.names), 40, "the nodes did not become idle")

    def on_node(self, node: int, *cmd: str) -> list[str]:
        """`cmd` as a process of node `node`: its network, its host name, its hosts file."""
        setup = 'hostname "$0" && mount --bind "$1" /etc/hosts && shift && exec "$@"'
        return [
            *self.nodes.enter(node),
            "unshare",
            "--uts",
            "--mount",
            "sh",
            "-c",
            setup,
            self.names[node],
            str(self.root / "hosts"),
            *cmd,
        ]

    def spawn(self, name: str, cmd: list[str]) -> None:
        log = open(self.root / "log" / f"{name}.stdout", "w")
        self.procs[name] = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
        )

    def wait_for(self, ready, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            dead = [n for n, p in self.procs.items() if p.poll() is not None]
            if dead:
                raise RuntimeError(f"{', '.join(dead)} exited (code {self.procs[dead[0]].returncode}) while starting")
            if ready():
                return
            time.sleep(0.5)
        raise RuntimeError(f"{what} within {timeout:.0f} s")

    def sinfo_states(self) -> list[str]:
        proc = self.run("sinfo", "-h", "-N", "-o", "%T", timeout=10)
        return proc.stdout.split()

    def run(self, *cmd: str, timeout: float = 30, cwd: Path | None = None) -> subprocess.CompletedProcess:
        """A SLURM client command (sbatch, scontrol ...) on node 0, where it reaches slurmctld."""
        return subprocess.run(
            [*self.nodes.enter(0), *cmd], env=self.env, capture_output=True, text=True, timeout=timeout, cwd=cwd
        )

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job` as a dict (JobState, Restarts, ExitCode ...); {} once SLURM forgot the job."""
        proc = self.run("scontrol", "-o", "show", "job", job_id)
        fields = {}
        for word in proc.stdout.split():
            key, eq, value = word.partition("=")
            if eq:
                fields.setdefault(key, value)
        return fields

    def stop(self) -> None:
        try:
            self.run("scancel", "--full", "--partition=test", timeout=10)
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and self.run("squeue", "-h", timeout=10).stdout.strip():
                time.sleep(0.5)
        except (subprocess.SubprocessError, OSError):
            pass
        for name in [*(n for n in self.procs if n.startswith("slurmd")), "slurmctld", "munged"]:
            proc = self.procs.get(name)
            if proc is None or proc.poll() is not None:
                continue
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)


@pytest.fixture(scope="module")
def slurm_cluster(tmp_path_factory):
    need_root_and("munged", "slurmctld", "slurmd", "sbatch", "scontrol")
    tag = f"phs{os.getpid() % 100000}"
    nodes = linked_namespaces(tag, "10.79.0")
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"), nodes, [f"{tag}-a", f"{tag}-b"])
    try:
        cluster.start()
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        logs = cluster.logs()
        cluster.stop()
        nodes.remove()
        pytest.fail(f"the SLURM test cluster did not start: {exc}\n{logs}", pytrace=False)
    yield cluster
    cluster.stop()
    nodes.remove()
