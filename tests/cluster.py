"""A second host and a Spark standalone cluster, for tests and benchmarks that
run the consumer the way a cluster runs it.

* :class:`NetworkNamespace` -- another "host": a network namespace joined to
  this one by a veth pair (``host_ip`` on our side, ``peer_ip`` inside, a /30
  of 10.213.0.0/16 no interface here uses). Servers that the other host must
  reach listen on ``host_ip``. Created on enter, removed on exit (also after a
  failure), together with every process still running inside it.
* :class:`SparkStandalone` -- a Spark standalone master on this host and one
  worker inside the namespace, both started from the pyspark wheel's
  ``spark-class`` (the wheel is a Spark installation), with a conf dir of
  their own. The worker's environment names no Python of ours: executors run
  whatever the application ships (``spark.pyspark.python``).
* :func:`readme_commands` -- the README's command blocks for a cluster, which
  tests and benchmarks run as written (in :func:`user_env`, the shell of a
  user whose walbridge environment is active).

Both need root (``ip netns``); :func:`namespaces_unavailable` says why they
cannot be made here, for a clear skip.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import pyspark
from tenacity import retry, retry_if_exception, stop_after_attempt

from walbridge.embedded import free_port

SPARK_HOME = Path(pyspark.__file__).parent
ROOT = Path(__file__).resolve().parent.parent
_PREFIX = "10.213"
_README_BLOCK = re.compile(r"<!-- cluster-test: ([\w-]+) -->\s*```bash\n(.*?)```", re.S)


def readme_commands() -> dict[str, str]:
    """The README's command blocks marked ``<!-- cluster-test: NAME -->``."""
    return dict(_README_BLOCK.findall((ROOT / "README.md").read_text()))


def user_env(**extra: str) -> dict[str, str]:
    """The environment of a user's shell with this walbridge environment active."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYSPARK_PYTHON", "PYSPARK_DRIVER_PYTHON")}
    return {**env, "PATH": f"{Path(sys.executable).parent}:{env.get('PATH', '')}", **extra}


def _ip(*args: str, netns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    cmd = ["ip", *(("-n", netns) if netns else ()), *args]
    return subprocess.run(cmd, capture_output=True, text=True, check=check, timeout=30)


def namespaces_unavailable() -> str | None:
    """Why a network namespace cannot be made here (None: it can)."""
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add)"
    name = f"wbprobe{uuid.uuid4().hex[:6]}"
    try:
        made = _ip("netns", "add", name, check=False)
    except FileNotFoundError:
        return "the ip command (iproute2) is not installed"
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.strip()}"
    _ip("netns", "delete", name, check=False)
    return None


class NetworkNamespace:
    """A network namespace with a veth pair to this one (see the module)."""

    def __init__(self) -> None:
        tag = uuid.uuid4().hex[:6]
        self.name = f"wb{tag}"
        self.host_if = f"wbh{tag}"  # interface names: 15 characters at most
        self.peer_if = f"wbp{tag}"
        self.host_ip = self.peer_ip = ""

    def _free_subnet(self) -> int:
        used = _ip("-4", "-o", "addr", "show").stdout
        free = [n for n in range(1, 16384) if f"{_PREFIX}.{n * 4 // 256}.{n * 4 % 256 + 1}/" not in used]
        return random.choice(free)

    def __enter__(self) -> NetworkNamespace:
        n = self._free_subnet()
        base = f"{_PREFIX}.{n * 4 // 256}."
        self.host_ip, self.peer_ip = f"{base}{n * 4 % 256 + 1}", f"{base}{n * 4 % 256 + 2}"
        self.network = f"{base}{n * 4 % 256}/30"
        try:
            _ip("netns", "add", self.name)
            _ip("link", "add", self.host_if, "type", "veth", "peer", "name", self.peer_if)
            _ip("link", "set", self.peer_if, "netns", self.name)
            _ip("addr", "add", f"{self.host_ip}/30", "dev", self.host_if)
            _ip("link", "set", self.host_if, "up")
            _ip("addr", "add", f"{self.peer_ip}/30", "dev", self.peer_if, netns=self.name)
            _ip("link", "set", self.peer_if, "up", netns=self.name)
            _ip("link", "set", "lo", "up", netns=self.name)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def command(self, *cmd: str) -> list[str]:
        """``cmd`` run inside the namespace."""
        return ["ip", "netns", "exec", self.name, *cmd]

    def pids(self) -> list[int]:
        out = _ip("netns", "pids", self.name, check=False).stdout
        return [int(p) for p in out.split()]

    def __exit__(self, *exc) -> None:
        # Whatever still runs in there was started by us (the namespace is ours).
        for pid in self.pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        _ip("netns", "delete", self.name, check=False)
        _ip("link", "delete", self.host_if, check=False)  # gone with the namespace, unless that failed


def cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def group_processes(pgid: int) -> dict[int, list[str]]:
    """The live processes of process group ``pgid`` (a process started in a
    session of its own, and all it started), each with its arguments."""
    found = {}
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and os.getpgid(int(entry)) == pgid and (argv := cmdline(int(entry))):
                found[int(entry)] = argv
        except OSError:  # gone meanwhile
            continue
    return found


def mapped_files(pid: int) -> set[str]:
    """The files a process has mapped (its loaded shared libraries among them)."""
    try:
        lines = Path(f"/proc/{pid}/maps").read_text().splitlines()
    except OSError:
        return set()
    return {line.split(None, 5)[5] for line in lines if len(line.split(None, 5)) == 6
            and line.split(None, 5)[5].startswith("/")}


def _timed_out(error: BaseException) -> bool:
    return isinstance(error, TimeoutError) or isinstance(getattr(error, "reason", None), TimeoutError)


@retry(retry=retry_if_exception(_timed_out), stop=stop_after_attempt(6), reraise=True)
def get_json(url: str, timeout: float = 10.0):
    """A Spark UI's JSON answer. A UI that is up but slow to answer (its JVM
    busy on a loaded machine) is asked again, up to a minute in all; a
    refused connection is raised at once (callers wait for a UI to start)."""
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.load(r)


class SparkStandalone:
    """A Spark standalone master (this host, ``netns.host_ip``) and one worker
    (inside ``netns``, ``netns.peer_ip``) with ``cores`` and ``memory``.

    Its conf dir's ``spark-defaults.conf`` (what an operator would write there)
    gives an application's driver its UI on ``driver_ui_port``, where Spark's
    REST API answers (:meth:`app_rest`); one application at a time."""

    def __init__(self, netns: NetworkNamespace, base_dir: Path, cores: int = 2, memory: str = "2g"):
        self.netns = netns
        self.base_dir = Path(base_dir)
        self.conf_dir = self.base_dir / "conf"
        self.work_dir = self.base_dir / "work"  # the worker's: one dir per application and executor
        self.cores, self.memory = cores, memory
        self.port = free_port(netns.host_ip)
        self.ui_port = free_port(netns.host_ip)
        self.driver_ui_port = free_port(netns.host_ip)
        self._master: subprocess.Popen | None = None
        self._worker: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"spark://{self.netns.host_ip}:{self.port}"

    def env(self) -> dict[str, str]:
        """For spark-class, spark-submit: this Spark home and conf dir, no Python of ours."""
        env = {k: v for k, v in os.environ.items()
               if k not in ("PYSPARK_PYTHON", "PYSPARK_DRIVER_PYTHON", "PYTHONPATH", "VIRTUAL_ENV")}
        return {**env, "SPARK_HOME": str(SPARK_HOME), "SPARK_CONF_DIR": str(self.conf_dir),
                "SPARK_LOG_DIR": str(self.base_dir / "logs")}

    def _spawn(self, cmd: list[str], log_name: str) -> subprocess.Popen:
        with open(self.base_dir / log_name, "ab") as log:
            return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                    env=self.env(), cwd=self.base_dir, start_new_session=True)

    def start(self, timeout: float = 90.0) -> SparkStandalone:
        self.conf_dir.mkdir(parents=True, exist_ok=True)
        self.work_dir.mkdir(parents=True, exist_ok=True)
        (self.conf_dir / "spark-defaults.conf").write_text(f"spark.ui.port {self.driver_ui_port}\n")
        spark_class = str(SPARK_HOME / "bin" / "spark-class")
        self._master = self._spawn([spark_class, "org.apache.spark.deploy.master.Master", "--host",
                                    self.netns.host_ip, "--port", str(self.port), "--webui-port",
                                    str(self.ui_port)], "master.log")
        self._worker = self._spawn(self.netns.command(
            spark_class, "org.apache.spark.deploy.worker.Worker", "--host", self.netns.peer_ip,
            "--cores", str(self.cores), "--memory", self.memory, "--work-dir", str(self.work_dir),
            "--webui-port", "0", self.url), "worker.log")
        deadline = time.monotonic() + timeout
        while True:
            for proc, name in ((self._master, "master"), (self._worker, "worker")):
                if proc.poll() is not None:
                    raise RuntimeError(f"the Spark {name} exited ({proc.returncode}); see "
                                       f"{self.base_dir / (name + '.log')}")
            try:
                if self.master_state().get("aliveworkers", 0) >= 1:
                    return self
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"no worker registered with {self.url} after {timeout}s")
            time.sleep(0.5)

    def master_state(self) -> dict:
        """The master's JSON view: workers, active and completed applications."""
        return get_json(f"http://{self.netns.host_ip}:{self.ui_port}/json/")

    def app_rest(self, path: str = ""):
        """Spark's REST API of the running application's driver (``path`` under the application)."""
        base = f"http://{self.netns.host_ip}:{self.driver_ui_port}/api/v1/applications"
        app = get_json(base)[0]["id"]
        return get_json(f"{base}/{app}{path}")

    def executor_pids(self) -> list[int]:
        """The executor JVMs running inside the namespace."""
        return [p for p in self.netns.pids() if any("CoarseGrainedExecutorBackend" in a for a in cmdline(p))]

    def stop(self) -> None:
        for proc in (self._worker, self._master):
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(20)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(10)
        self._worker = self._master = None

    def __enter__(self) -> SparkStandalone:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()
