"""The stable endpoint: nginx (Debian's package, scripts/setup.sh) in front of whichever vLLM server is live.

One nginx master per deployment, run as this user from `<run_dir>/serving/nginx/` (its config, pid,
logs and temp files all live there; nothing under /etc or /var is read or written). Switching the
live server is a new config plus SIGHUP (what `nginx -s reload` sends): the master keeps its
listening socket, starts workers with the new upstream and lets the old workers finish the requests
they hold (`worker_shutdown_timeout` bounds that) — no connection is refused during a switch. A
config that fails `nginx -t` is never loaded; a reload is confirmed by the generation number every
answer carries (`X-Glm-Lora-Generation`), not assumed.

The access log records method, path (no query string), status, sizes and times — never a header, so
the endpoint's API key (`Authorization`) is never written. The key itself is checked by vLLM behind it
(README "Security"); nginx passes the header through untouched.
"""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

from glm_lora.configs.errors import UserError

_LOCAL = urllib.request.build_opener(urllib.request.ProxyHandler({}))
GENERATION_HEADER = "X-Glm-Lora-Generation"
CONF = "nginx.conf"

_TEMPLATE = """# Written by glm-lora (serve/proxy.py) for the endpoint {listen}; generation {generation}.
# The live vLLM server: 127.0.0.1:{backend_port}. Reloaded with SIGHUP on every promotion.
{user}worker_processes 1;
pid {home}/nginx.pid;
error_log {home}/error.log warn;
# A switch waits at most this long for requests still running on the old server.
worker_shutdown_timeout {drain_s}s;

events {{
    worker_connections 4096;
}}

http {{
    # No header is logged: the Authorization header (the API key) never reaches a file.
    log_format glm_lora '$time_iso8601 $remote_addr "$request_method $uri" $status $body_bytes_sent '
                        '$request_time upstream=$upstream_addr $upstream_response_time';
    access_log {home}/access.log glm_lora;
    client_body_temp_path {home}/tmp/body;
    proxy_temp_path {home}/tmp/proxy;
    fastcgi_temp_path {home}/tmp/fastcgi;
    uwsgi_temp_path {home}/tmp/uwsgi;
    scgi_temp_path {home}/tmp/scgi;
    client_max_body_size 64m;
    server_tokens off;

    upstream glm_lora_live {{
        server 127.0.0.1:{backend_port};
        keepalive 32;
    }}

    server {{
        listen {listen};
        location / {{
            proxy_pass http://glm_lora_live;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_set_header Host $host;
            proxy_buffering off;            # streamed tokens (server-sent events) go out as they are made
            proxy_read_timeout {read_timeout_s}s;
            proxy_send_timeout {read_timeout_s}s;
            proxy_next_upstream off;        # never send a generation request twice
            add_header {header} {generation} always;
        }}
    }}
}}
"""


def nginx_binary() -> str:
    """$GLM_LORA_NGINX, else nginx on PATH or in /usr/sbin (where Debian puts it, often off a user's PATH)."""
    found = os.environ.get("GLM_LORA_NGINX") or shutil.which("nginx") or (
        "/usr/sbin/nginx" if os.access("/usr/sbin/nginx", os.X_OK) else None)
    if not found:
        raise UserError("nginx is not installed: the stable endpoint (serve.port) is an nginx reverse proxy. Run "
                        "`bash scripts/setup.sh` (it installs Debian's nginx-light) or `apt-get install nginx-light`")
    return found


def _listen(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def write_conf(home: Path, *, host: str, port: int, backend_port: int, generation: int, drain_s: int,
               read_timeout_s: int = 600) -> Path:
    """The config for `generation` (atomically replaced), checked with `nginx -t` before anyone loads it."""
    home = Path(home).resolve()
    for sub in ("tmp/body", "tmp/proxy", "tmp/fastcgi", "tmp/uwsgi", "tmp/scgi"):
        (home / sub).mkdir(parents=True, exist_ok=True)
    text = _TEMPLATE.format(listen=_listen(host, port), generation=generation, backend_port=backend_port,
                            home=home, drain_s=drain_s, read_timeout_s=read_timeout_s, header=GENERATION_HEADER,
                            # as root, the workers would otherwise run as nobody (unable to write our logs)
                            user="user root;\n" if os.geteuid() == 0 else "")
    tmp = home / f".{CONF}.new"
    tmp.write_text(text)
    test = subprocess.run([nginx_binary(), "-t", "-q", "-p", str(home), "-e", str(home / "error.log"), "-c", str(tmp)],
                          capture_output=True, text=True)
    if test.returncode != 0:
        tmp.unlink()
        raise RuntimeError(f"nginx -t refused the generated config: {test.stderr.strip()[-2000:]}")
    os.replace(tmp, home / CONF)
    return home / CONF


def conf_generation(home: Path) -> int:
    """The generation of the config in `home` (0 if there is none)."""
    m = re.search(r"; generation (\d+)\.", _conf_text(home))
    return int(m.group(1)) if m else 0


def conf_backend(home: Path) -> int | None:
    """The backend port the config in `home` sends requests to (None if there is no config)."""
    m = re.search(r"server 127\.0\.0\.1:(\d+);", _conf_text(home))
    return int(m.group(1)) if m else None


def _conf_text(home: Path) -> str:
    try:
        return (Path(home) / CONF).read_text()
    except FileNotFoundError:
        return ""


def is_ours(pid: int, home: Path) -> bool:
    """True if pid is the nginx master started with this home's config (a recorded pid may be reused)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z" and b"nginx" in cmdline and str(Path(home).resolve() / CONF).encode() in cmdline


def workers(pid: int) -> set[int]:
    """Live worker processes of the nginx master pid."""
    out = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, ppid = stat.read_text().rsplit(")", 1)[1].split()[:2]
        except (OSError, ValueError):
            continue
        if int(ppid) == pid and state != "Z":
            out.add(int(stat.parent.name))
    return out


def start(home: Path, *, host: str, port: int, generation: int, timeout_s: float = 15) -> int:
    """Start the master (config already written) in its own session; return its pid once the endpoint
    answers with this generation (the backend's own answer may be anything: nginx itself is up)."""
    home = Path(home).resolve()
    log = open(home / "nginx.out", "ab")
    with log:
        proc = subprocess.Popen([nginx_binary(), "-p", str(home), "-e", str(home / "error.log"), "-c", str(home / CONF),
                                 "-g", "daemon off; master_process on;"],
                                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, cwd=str(home),
                                start_new_session=True)
    try:
        wait_generation(host, port, generation, timeout_s, lambda: proc.poll() is None)
    except BaseException:
        stop(proc.pid, home)
        raise
    return proc.pid


def reload(pid: int, home: Path, *, host: str, port: int, generation: int, timeout_s: float = 15) -> set[int]:
    """Load the current config into the running master; return the old workers (which finish what they
    hold, then exit: `wait_drained`). Raises if the new generation does not answer in time."""
    if not is_ours(pid, home):
        raise RuntimeError(f"pid {pid} is not the nginx of {home}")
    old = workers(pid)
    os.kill(pid, signal.SIGHUP)
    wait_generation(host, port, generation, timeout_s, lambda: is_ours(pid, home))
    # An old worker still accepts connections until it handles its QUIT; it then closes its listening
    # socket and retitles itself at once. Only then does every new request reach the new generation.
    deadline = time.monotonic() + timeout_s
    while any(_accepting(w) for w in old):
        if time.monotonic() > deadline:
            raise RuntimeError(f"nginx's previous workers {sorted(old)} did not stop accepting within {timeout_s:.0f}s")
        time.sleep(0.02)
    return old


def _accepting(worker: int) -> bool:
    """A worker that has not begun its graceful shutdown (an exited one does not accept)."""
    try:
        title = Path(f"/proc/{worker}/cmdline").read_bytes()
        state = Path(f"/proc/{worker}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z" and b"shutting down" not in title


def wait_generation(host: str, port: int, generation: int, timeout_s: float, alive) -> None:
    """Poll the endpoint until an answer carries `generation` (any HTTP status counts: nginx answered)."""
    url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}/health"
    deadline = time.monotonic() + timeout_s
    seen = None
    while time.monotonic() < deadline:
        try:
            with _LOCAL.open(url, timeout=5) as r:
                seen = r.headers.get(GENERATION_HEADER)
        except urllib.error.HTTPError as e:
            seen = e.headers.get(GENERATION_HEADER)
        except OSError:
            seen = None
        if seen == str(generation):
            return
        if not alive():
            raise RuntimeError(f"nginx exited (see its error.log); the endpoint answered generation {seen}")
        time.sleep(0.05)
    raise RuntimeError(f"nginx did not switch to generation {generation} within {timeout_s:.0f}s (answers: {seen})")


def wait_drained(old_workers: set[int], timeout_s: float) -> bool:
    """Wait until the workers of the previous generation have exited (their requests done); True if they did."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        live = set()
        for pid in old_workers:
            try:
                if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                    live.add(pid)
            except OSError:
                pass
        if not live:
            return True
        time.sleep(0.1)
    return False


def stop(pid: int, home: Path, timeout_s: float = 10) -> None:
    """Graceful stop (SIGQUIT: finish requests), then SIGTERM/SIGKILL to the master's group."""
    if not is_ours(pid, home):
        return
    for sig, wait_s in ((signal.SIGQUIT, timeout_s), (signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        with contextlib.suppress(ProcessLookupError):
            if sig == signal.SIGQUIT:
                os.kill(pid, sig)       # the master tells its workers to finish their requests
            else:
                os.killpg(pid, sig)     # master and workers (its own session: start())
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)
            if not is_ours(pid, home) and not workers(pid):
                return
            time.sleep(0.1)
