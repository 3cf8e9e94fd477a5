"""A real one-node SLURM cluster for the tests (issue 23 item 4): munged, slurmctld and slurmd of Debian's `slurm-wlm`
and `munge`, started as root on this host with everything (config, munge key and socket, state, spool, logs) in a
temporary folder, and stopped when the session ends.

`slurm_cluster` (session fixture) installs the packages with apt-get when the programs are missing, writes a minimal
slurm.conf (one node: this host, with `nproc` CPUs; `proctrack/linuxproc`, `task/none`, no cgroup plugin, no
accounting; `select/cons_tres` by CPU), starts the three daemons in the foreground, waits until `sinfo` shows the
node idle and points SLURM_CONF at that config for the session, so sbatch, squeue and submitit reach this cluster
and no other. Without root, or without the programs and apt-get to install them, the test is skipped with a message
saying exactly that; any other failure to start fails the test with the daemons' logs.

Import the fixture into a test module: `from tests.slurm_cluster import slurm_cluster  # noqa: F401`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import secrets
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGES = ("slurm-wlm", "munge")
PROGRAMS = ("munged", "slurmctld", "slurmd", "sbatch", "sinfo", "squeue", "scancel", "scontrol", "srun")
PARTITION = "debug"
START_TIMEOUT_S = 90.0


@dataclasses.dataclass
class SlurmCluster:
    """A running one-node cluster: its config (SLURM_CONF), node name, CPUs, partition and folder."""

    conf: Path
    node: str
    cpus: int
    partition: str
    folder: Path

    def command(self, *args: str, timeout_s: float = 30.0) -> str:
        """Run a SLURM client command against this cluster; its stdout (CalledProcessError on failure)."""
        return subprocess.run(list(args), check=True, capture_output=True, text=True, timeout=timeout_s,
                              env={**os.environ, "SLURM_CONF": str(self.conf)}).stdout

    def log_tails(self, chars: int = 3000) -> str:
        """The end of every daemon's log, for failure messages."""
        parts = []
        for log in sorted(self.folder.glob("*.log")):
            with contextlib.suppress(OSError):
                parts.append(f"--- {log.name}:\n{log.read_text(errors='replace')[-chars:]}")
        return "\n".join(parts)


def why_no_cluster() -> str | None:
    """Why this machine cannot start the cluster (None when it can): the daemons must run as root, and the programs
    must be installed or installable with apt-get."""
    if os.geteuid() != 0:
        return (f"a one-node SLURM cluster needs root (munged, slurmctld and slurmd run as root, and installing "
                f"Debian's {' and '.join(PACKAGES)} needs apt-get as root); this test runs as uid {os.geteuid()}")
    missing = [name for name in PROGRAMS if shutil.which(name) is None]
    if missing and shutil.which("apt-get") is None:
        return (f"SLURM is not installed ({', '.join(missing)} missing) and there is no apt-get to install "
                f"Debian's {' and '.join(PACKAGES)}")
    return None


def install() -> None:
    """apt-get install the packages when a program is missing (an `apt-get update` first if that fails)."""
    if all(shutil.which(name) for name in PROGRAMS):
        return
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    command = ["apt-get", "install", "-y", "--no-install-recommends", *PACKAGES]
    result = subprocess.run(command, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        subprocess.run(["apt-get", "update"], env=env, capture_output=True, text=True)
        result = subprocess.run(command, env=env, capture_output=True, text=True)
    missing = [name for name in PROGRAMS if shutil.which(name) is None]
    if result.returncode != 0 or missing:
        pytest.fail(f"`{' '.join(command)}` failed (exit {result.returncode}; missing {missing}):\n"
                    f"{(result.stdout + result.stderr)[-4000:]}")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def slurm_conf(folder: Path, node: str, cpus: int) -> str:
    """The cluster's slurm.conf: one node (this host at 127.0.0.1), root daemons, state and logs under `folder`."""
    return "\n".join([
        "ClusterName=rstartest",
        f"SlurmctldHost={node}(127.0.0.1)",
        f"SlurmctldPort={free_port()}",
        f"SlurmdPort={free_port()}",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo=socket={folder / 'munge.socket'}",
        "SlurmUser=root",
        "SlurmdUser=root",
        f"StateSaveLocation={folder / 'state'}",
        f"SlurmdSpoolDir={folder / 'spool'}",
        f"SlurmctldPidFile={folder / 'slurmctld.pid'}",
        f"SlurmdPidFile={folder / 'slurmd.pid'}",
        f"SlurmctldLogFile={folder / 'slurmctld.log'}",
        f"SlurmdLogFile={folder / 'slurmd.log'}",
        f"PlugStackConfig={folder / 'plugstack.conf'}",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_CPU",
        "SchedulerType=sched/backfill",
        "SchedulerParameters=sched_interval=2,bf_interval=1",
        "SlurmdParameters=config_overrides",
        "MpiDefault=none",
        "SwitchType=switch/none",
        "ReturnToService=2",
        "MailProg=/bin/true",
        "KillWait=5",
        "InactiveLimit=0",
        f"NodeName={node} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN",
        f"PartitionName={PARTITION} Nodes={node} Default=YES MaxTime=INFINITE State=UP",
        "",
    ])


def stop(process: subprocess.Popen, grace_s: float = 10.0) -> None:
    """SIGTERM `process`, SIGKILL it after `grace_s`."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(grace_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@contextlib.contextmanager
def running_cluster(folder: Path) -> Iterator[SlurmCluster]:
    """Start munged, slurmctld and slurmd in `folder` and yield the cluster once its node is idle; stop them (after
    cancelling every job left) when the block ends."""
    folder.mkdir(parents=True, exist_ok=True)
    folder.chmod(0o700)
    for name in ("state", "spool"):
        (folder / name).mkdir(exist_ok=True)
    (folder / "plugstack.conf").write_text("")
    key = folder / "munge.key"
    key.write_bytes(secrets.token_bytes(1024))
    key.chmod(0o600)
    node, cpus = socket.gethostname().split(".")[0], len(os.sched_getaffinity(0))
    cluster = SlurmCluster(folder / "slurm.conf", node, cpus, PARTITION, folder)
    cluster.conf.write_text(slurm_conf(folder, node, cpus))
    env = {**os.environ, "SLURM_CONF": str(cluster.conf)}
    daemons: list[subprocess.Popen] = []

    def start(name: str, command: list[str]) -> None:
        with open(folder / f"{name}.out", "wb") as out:
            daemons.append(subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=folder))

    try:
        start("munged", ["munged", "--foreground", "--force", f"--key-file={key}",
                         f"--socket={folder / 'munge.socket'}", f"--pid-file={folder / 'munged.pid'}",
                         f"--log-file={folder / 'munged.log'}", f"--seed-file={folder / 'munged.seed'}"])
        deadline = time.monotonic() + START_TIMEOUT_S
        while not (folder / "munge.socket").exists():
            if daemons[0].poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("munged did not start:\n" + (folder / "munged.out").read_text(errors="replace")
                                   + cluster.log_tails())
            time.sleep(0.1)
        start("slurmctld", ["slurmctld", "-D", "-c", "-i", "-f", str(cluster.conf)])
        start("slurmd", ["slurmd", "-D", "-c", "-f", str(cluster.conf), "-N", node])
        state = ""
        while state != "idle":
            for daemon in daemons:
                if daemon.poll() is not None:
                    raise RuntimeError(f"{daemon.args[0]} exited with {daemon.returncode}:\n" + cluster.log_tails()
                                       + "".join(f"\n--- {out.name}:\n{out.read_text(errors='replace')[-2000:]}"
                                                 for out in folder.glob("*.out")))
            if time.monotonic() > deadline:
                raise RuntimeError(f"the node is not idle after {START_TIMEOUT_S:g} s (sinfo: {state!r}):\n"
                                   + cluster.log_tails())
            time.sleep(0.5)
            with contextlib.suppress(subprocess.SubprocessError):
                state = cluster.command("sinfo", "-h", "-N", "-o", "%T", timeout_s=10).strip()
        yield cluster
    finally:
        with contextlib.suppress(subprocess.SubprocessError, OSError):
            if daemons and all(daemon.poll() is None for daemon in daemons):
                cluster.command("scancel", "--full", f"--partition={PARTITION}")
                deadline = time.monotonic() + 20
                while cluster.command("squeue", "-h").strip() and time.monotonic() < deadline:
                    time.sleep(0.5)
        for daemon in reversed(daemons):
            stop(daemon)


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    """The session's one-node SLURM cluster (see the module docstring); SLURM_CONF names it while it runs."""
    reason = why_no_cluster()
    if reason is not None:
        pytest.skip(f"cannot start a one-node SLURM cluster: {reason}")
    install()
    folder = tmp_path_factory.mktemp("slurm")
    try:
        context = running_cluster(folder)
        cluster = context.__enter__()
    except RuntimeError as exc:
        pytest.fail(f"the one-node SLURM cluster did not start: {exc}")
    previous = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(cluster.conf)
    try:
        yield cluster
    finally:
        if previous is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = previous
        context.__exit__(None, None, None)
