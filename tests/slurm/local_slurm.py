"""A single-node SLURM cluster on localhost, from Debian's packages, for the launcher tests.

`install()` puts slurm-wlm and munge in place with apt-get unless they are there already.
`LocalSlurm(root).start()` writes a munge key and a minimal slurm.conf under `root` (one node, this
host, at 127.0.0.1; cons_tres select, linuxproc process tracking, no cgroups, no accounting, free
ports), and starts munged, slurmctld and slurmd in the foreground as children of this process.
`stop()` cancels what is queued and ends exactly those three processes. Clients find the cluster
through `env()` (SLURM_CONF); nothing under /etc is changed.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

PACKAGES = ("slurm-wlm", "munge")
BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "sinfo")
PARTITION = "rbstest"


class Unavailable(Exception):
    """This machine cannot host the cluster (not root, or no apt-get); the reason is the text."""


def binary(name: str) -> str | None:
    """Full path of a program (daemons live in /usr/sbin, which a user's PATH may lack)."""
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin")


def install() -> str:
    """Install the Debian packages unless every binary is already there; returns what it did."""
    if all(binary(b) for b in BINARIES):
        return "already installed"
    if os.geteuid() != 0:
        raise Unavailable("installing slurm-wlm and munge needs root")
    if shutil.which("apt-get") is None:
        raise Unavailable("installing slurm-wlm and munge needs apt-get (Debian/Ubuntu)")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    lock = ["-o", "DPkg::Lock::Timeout=300"]  # wait for another apt-get rather than fail
    cmd = ["apt-get", "install", "-y", "-q", *lock, "--no-install-recommends", *PACKAGES]
    if subprocess.run(cmd, env=env, capture_output=True).returncode != 0:
        # a fresh machine has no package lists yet (or stale ones)
        subprocess.run(["apt-get", "update", "-q", *lock], env=env, capture_output=True, check=True)
        subprocess.run(cmd, env=env, capture_output=True, check=True)
    missing = [b for b in BINARIES if binary(b) is None]
    if missing:
        raise RuntimeError(f"apt-get installed {PACKAGES} but {missing} are not on PATH")
    return "installed " + " ".join(PACKAGES)


def _free_ports(n: int) -> list[int]:
    """n distinct ports nobody listens on (all held open while chosen, so they differ)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class LocalSlurm:
    def __init__(self, root: Path, cpus: int | None = None):
        self.root = Path(root)
        self.host = socket.gethostname().split(".")[0]
        self.cpus = cpus or os.cpu_count() or 1
        self.procs: dict[str, subprocess.Popen] = {}
        self.conf = self.root / "etc" / "slurm.conf"
        self.munge_socket = self.root / "munge" / "munge.socket"

    # -- setup -------------------------------------------------------------------------------
    def env(self, **extra: str) -> dict[str, str]:
        """The environment for slurm clients (and, through sbatch, for the jobs)."""
        return dict(os.environ, SLURM_CONF=str(self.conf), **extra)

    def _write_config(self) -> None:
        for sub in ("etc", "munge", "state", "spool", "log"):
            (self.root / sub).mkdir(parents=True, exist_ok=True, mode=0o700)
        key = self.root / "munge" / "munge.key"
        if not key.exists():
            key.write_bytes(os.urandom(1024))
            key.chmod(0o600)
        r, log = self.root, self.root / "log"
        auth = f"socket={self.munge_socket}"
        ctld_port, slurmd_port = _free_ports(2)
        self.conf.write_text(
            "\n".join(
                [
                    "ClusterName=rbstest",
                    f"SlurmctldHost={self.host}(127.0.0.1)",
                    f"SlurmctldPort={ctld_port}",
                    f"SlurmdPort={slurmd_port}",
                    "SlurmUser=root",
                    "SlurmdUser=root",
                    "AuthType=auth/munge",
                    "CredType=cred/munge",
                    f"AuthInfo={auth}",
                    f"StateSaveLocation={r / 'state'}",
                    f"SlurmdSpoolDir={r / 'spool'}",
                    f"SlurmctldPidFile={r / 'slurmctld.pid'}",
                    f"SlurmdPidFile={r / 'slurmd.pid'}",
                    f"SlurmctldLogFile={log / 'slurmctld.log'}",
                    f"SlurmdLogFile={log / 'slurmd.log'}",
                    "ProctrackType=proctrack/linuxproc",
                    "TaskPlugin=task/none",
                    "JobAcctGatherType=jobacct_gather/none",
                    "AccountingStorageType=accounting_storage/none",
                    "JobCompType=jobcomp/none",
                    "SelectType=select/cons_tres",
                    "SelectTypeParameters=CR_CPU",
                    "SchedulerType=sched/backfill",
                    "MpiDefault=none",
                    "ReturnToService=2",
                    "KillWait=5",
                    "MinJobAge=600",
                    "SlurmctldTimeout=30",
                    "SlurmdTimeout=30",
                    "InactiveLimit=0",
                    "SlurmctldDebug=info",
                    "SlurmdDebug=info",
                    f"NodeName={self.host} NodeAddr=127.0.0.1 CPUs={self.cpus} State=UNKNOWN",
                    f"PartitionName={PARTITION} Nodes={self.host} Default=YES "
                    "MaxTime=INFINITE State=UP",
                    "",
                ]
            )
        )

    def _spawn(self, name: str, cmd: list[str]) -> None:
        cmd = [binary(cmd[0]), *cmd[1:]]
        out = open(self.root / "log" / f"{name}.out", "ab")
        self.procs[name] = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=self.env()
        )
        out.close()

    def start(self, timeout: float = 60) -> None:
        self._write_config()
        m = self.root / "munge"
        self._spawn(
            "munged",
            [
                "munged",
                "--foreground",
                "--force",
                f"--socket={self.munge_socket}",
                f"--key-file={m / 'munge.key'}",
                f"--pid-file={m / 'munged.pid'}",
                f"--log-file={self.root / 'log' / 'munged.log'}",
                f"--seed-file={m / 'munged.seed'}",
            ],
        )
        self._wait(lambda: self.munge_socket.exists(), timeout, "munged to open its socket")
        self._spawn("slurmctld", ["slurmctld", "-D", "-i", "-f", str(self.conf)])
        self._wait(lambda: self._ok(["scontrol", "ping"], "UP"), timeout, "slurmctld to answer")
        self._spawn("slurmd", ["slurmd", "-D", "-f", str(self.conf), "-N", self.host])
        self._wait(self._node_idle, timeout, f"node {self.host} to become idle")

    def _ok(self, cmd: list[str], needle: str) -> bool:
        res = self.run(*cmd, check=False)
        return res.returncode == 0 and needle in res.stdout

    def _node_idle(self) -> bool:
        out = self.run("sinfo", "-h", "-N", "-o", "%T").stdout.strip()
        return out.startswith("idle")

    def _wait(self, ready, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            dead = [n for n, p in self.procs.items() if p.poll() is not None]
            if dead:
                raise RuntimeError(f"{dead[0]} exited; log:\n{self.logs()}")
            if ready():
                return
            time.sleep(0.2)
        raise TimeoutError(f"gave up waiting for {what} after {timeout:.0f}s; log:\n{self.logs()}")

    def logs(self, tail: int = 3000) -> str:
        parts = []
        for path in sorted((self.root / "log").glob("*")):
            parts.append(f"== {path.name}\n{path.read_text(errors='replace')[-tail:]}")
        return "\n".join(parts)

    def stop(self) -> None:
        """Cancel what is still queued, then end the daemons this object started (slurmd first)."""
        if self.procs.get("slurmctld") and self.procs["slurmctld"].poll() is None:
            self.run("scancel", f"--partition={PARTITION}", check=False)
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and self.run("squeue", "-h", check=False).stdout:
                time.sleep(0.5)
        for name in ("slurmd", "slurmctld", "munged"):
            proc = self.procs.pop(name, None)
            if proc is None or proc.poll() is not None:
                continue
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=15)

    # -- clients -----------------------------------------------------------------------------
    def run(self, *cmd: str, check: bool = True, **env: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [binary(cmd[0]), *cmd[1:]],
            capture_output=True,
            text=True,
            env=self.env(**env),
            check=check,
        )

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job` fields of one job or array task (kept for MinJobAge)."""
        out = self.run("scontrol", "-o", "show", "job", job_id).stdout
        fields = {}
        for token in out.split():
            k, _, v = token.partition("=")
            fields.setdefault(k, v)
        return fields

    def wait_jobs(self, job_id: str, timeout: float) -> None:
        """Until no task of job `job_id` is pending, running or completing."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            out = self.run("squeue", "-h", "-r", "-j", job_id, "-o", "%i %T", check=False)
            if out.returncode == 0 and not out.stdout.strip():
                return
            if out.returncode != 0 and "Invalid job id" in out.stderr:
                return  # already purged: long finished
            time.sleep(0.5)
        raise TimeoutError(f"job {job_id} still queued after {timeout:.0f}s:\n{out.stdout}")
