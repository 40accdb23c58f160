"""certkv-serve as a child process for the server tests: start it on a free loopback port, wait
until /health answers 200, stop it. Shared by server_openai_check.py, server_load_check.py and
server_dashboard_check.py."""

import re
import subprocess
import time
import urllib.error
import urllib.request


class ServeError(RuntimeError):
    """The server exited, printed no port, or did not become healthy in time."""


def start_server(serve, args, log_path, timeout_s=60):
    """Runs `serve --port 0 ARGS`, its output in log_path; returns (process, port) once /health
    answers 200. Raises ServeError (with the log when the server exited) otherwise."""
    log = open(log_path, "w+")
    proc = subprocess.Popen([serve, "--port", "0", *args], stdout=log, stderr=subprocess.STDOUT)
    deadline = time.time() + timeout_s
    port = None
    while time.time() < deadline and port is None:
        log.seek(0)
        m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", log.read())
        if m:
            port = int(m.group(1))
        elif proc.poll() is not None:
            log.seek(0)
            raise ServeError("certkv-serve exited:\n" + log.read())
        else:
            time.sleep(0.1)
    if port is None:
        stop_server(proc)
        raise ServeError("certkv-serve printed no port")
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                if r.status == 200:
                    return proc, port
        except OSError:  # 503 while loading, or not accepting yet
            pass
        time.sleep(0.2)
    stop_server(proc)
    raise ServeError(f"certkv-serve did not become healthy within {timeout_s} s")


def stop_server(proc):
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
