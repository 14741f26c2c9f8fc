"""`python -m infinity replicas`: several servers on one machine behind nginx.

Starts N replicas of `python -m infinity serve` on consecutive ports, each in its own
process group and (when there are cores enough) on its own cores, and nginx in front of
them with `config/nginx.conf` (its `upstream infinity` servers and `listen` port set
to this launch's). A replica that dies is started again, with a back-off if it keeps
dying; nginx retries its requests on the others meanwhile. SIGTERM or SIGINT stops nginx
gracefully, then drains every replica (each one's own SIGTERM handling), and exits 0.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("infinity.replicas")

NGINX_CONFIG = Path(__file__).resolve().parent.parent / "config" / "nginx.conf"
# A replica that lived shorter than this before dying is restarted after a growing pause.
STABLE_AFTER_S = 30.0
MAX_RESTART_DELAY_S = 30.0
POLL_S = 0.2


def render_nginx_config(template: str, listen: int, ports: list[int], runtime: Path) -> str:
    """`template` (an nginx.conf with an `upstream infinity` block) with its upstream
    servers replaced by 127.0.0.1:`ports`, its `listen` by `listen`, and nginx's
    temporary folders inside `runtime` (so no system folder needs to be writable)."""
    upstream = re.search(r"upstream infinity \{.*?\n    \}", template, re.S)
    if upstream is None:
        raise ValueError("the nginx config has no 'upstream infinity { ... }' block")
    servers = re.findall(r"^( *)server \S+( [^;\n]*)?;$", upstream.group(0), re.M)
    if not servers:
        raise ValueError("the nginx config's upstream infinity block lists no server")
    indent, options = servers[0]
    lines = "".join(f"{indent}server 127.0.0.1:{port}{options};\n" for port in ports)
    block = re.sub(r"(?m)^ *server \S+( [^;\n]*)?;\n", "", upstream.group(0))
    block = block.replace("least_conn;\n", "least_conn;\n" + lines, 1)
    rendered = template.replace(upstream.group(0), block)
    rendered, listens = re.subn(r"(?m)^( *)listen \S+;", rf"\g<1>listen 127.0.0.1:{listen};", rendered)
    if listens != 1:
        raise ValueError("the nginx config must have exactly one 'listen' line")
    temp_paths = "".join(f"    {kind}_temp_path {runtime / kind};\n"
                         for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
    return rendered.replace("http {\n", "http {\n" + temp_paths, 1)


def split_cores(cores: list[int], replicas: int) -> list[list[int] | None]:
    """Contiguous core groups, one per replica, when each can have at least one core;
    otherwise no pinning (the replicas share every core)."""
    if replicas > len(cores):
        return [None] * replicas
    size, extra = divmod(len(cores), replicas)
    starts = [i * size + min(i, extra) for i in range(replicas + 1)]
    return [cores[a:b] for a, b in zip(starts, starts[1:])]


@dataclass
class Replica:
    index: int
    port: int
    cores: list[int] | None
    serve_args: list[str]
    process: subprocess.Popen | None = None
    started: float = 0.0
    failures: int = 0  # quick deaths in a row
    restart_at: float | None = None  # when a dead replica is started again

    def start(self) -> None:
        command = [sys.executable, "-m", "infinity", "serve", *self.serve_args, "--port", str(self.port)]
        cores = self.cores
        # Its own session: its children share its process group, which can be signalled
        # whole, and a Ctrl-C at the launcher's terminal reaches the launcher alone.
        self.process = subprocess.Popen(command, start_new_session=True,
                                        preexec_fn=(lambda: os.sched_setaffinity(0, cores)) if cores else None)
        self.started = time.monotonic()
        self.restart_at = None
        log.info("replica %d: pid %d, port %d, cores %s", self.index, self.process.pid, self.port,
                 ",".join(map(str, cores)) if cores else "all")

    def check(self, now: float) -> None:
        """Restart the replica if it died (after its back-off)."""
        assert self.process is not None
        if self.restart_at is None and self.process.poll() is not None:
            lived = now - self.started
            self.failures = self.failures + 1 if lived < STABLE_AFTER_S else 0
            delay = min(0.5 * 2 ** (self.failures - 1), MAX_RESTART_DELAY_S) if self.failures else 0.0
            log.warning("replica %d (port %d) exited with code %s after %.1f s; restarting in %.1f s",
                        self.index, self.port, self.process.returncode, lived, delay)
            self.restart_at = now + delay
        if self.restart_at is not None and now >= self.restart_at:
            self.start()

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)

    def wait(self, timeout: float) -> None:
        if self.process is None:
            return
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            log.warning("replica %d did not stop within %.0f s; killing its process group", self.index, timeout)
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


def run(replicas: int, listen: int, first_port: int, serve_args: list[str], nginx: str,
        config: Path, shutdown_timeout: float) -> int:
    """Serve until SIGTERM/SIGINT; the exit code (0 after a clean stop, 1 if nginx died)."""
    nginx_binary = shutil.which(nginx)
    if nginx_binary is None:
        log.error("nginx not found (%s): install it (Debian: apt-get install nginx)", nginx)
        return 1
    stop_requested = False

    def request_stop(signum: int, _frame: object) -> None:
        nonlocal stop_requested
        stop_requested = True

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    ports = [first_port + i for i in range(replicas)]
    cores = split_cores(sorted(os.sched_getaffinity(0)), replicas)
    group = [Replica(i, port, cores[i], serve_args) for i, port in enumerate(ports)]
    with tempfile.TemporaryDirectory(prefix="infinity-nginx-") as folder:
        runtime = Path(folder)
        runtime.chmod(0o755)
        for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"):
            # nginx's workers may run as another user than its master (root's: nobody).
            (runtime / kind).mkdir(mode=0o777)
            (runtime / kind).chmod(0o777)
        conf = runtime / "nginx.conf"
        conf.write_text(render_nginx_config(config.read_text(), listen, ports, runtime))
        for replica in group:
            replica.start()
        proxy = subprocess.Popen([nginx_binary, "-p", str(runtime), "-c", str(conf), "-g",
                                  f"daemon off; pid {runtime / 'nginx.pid'}; error_log stderr warn;"],
                                 start_new_session=True)
        log.info("nginx: pid %d, listening on 127.0.0.1:%d, replicas on ports %s", proxy.pid, listen,
                 ", ".join(map(str, ports)))
        code = 0
        while not stop_requested:
            if proxy.poll() is not None:
                log.error("nginx exited with code %s; stopping the replicas", proxy.returncode)
                code = 1
                break
            now = time.monotonic()
            for replica in group:
                replica.check(now)
            time.sleep(POLL_S)
        log.info("stopping: nginx first, then the replicas drain (up to %.0f s)", shutdown_timeout)
        if proxy.poll() is None:
            proxy.send_signal(signal.SIGQUIT)  # graceful: finish the requests it holds
        for replica in group:
            replica.stop()
        for replica in group:
            replica.wait(shutdown_timeout + 15)
        try:
            proxy.wait(shutdown_timeout + 15)
        except subprocess.TimeoutExpired:
            proxy.kill()
            proxy.wait()
    return code
