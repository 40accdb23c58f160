#!/usr/bin/env python3
"""The dashboard (GET /) in headless Chromium, driven over the DevTools protocol.

Starts certkv-serve on a free loopback port (fp8-e4m3, an API key) and Chromium with
--remote-debugging-port, opens the page and checks, with Python's standard library only (a minimal
WebSocket client below):
  - the page loads without a script error, and reports the missing API key until one is typed;
  - the numbers arrive from /dashboard/state (model, scheme, KV pool);
  - a chat typed into the chat box streams tokens into the page and ends with its certificate;
  - the heatmap gains the chat's decode steps: its cells change, and they match /dashboard/state.
--screenshot PATH saves the page after the chat (docs/dashboard.png is made this way).

Exit status: 0 passed, 1 failed, 77 skipped (no Chromium on this machine).
usage: server_dashboard_check.py --serve CERTKV_SERVE --model GGUF [--screenshot PNG]
"""
import argparse
import base64
import json
import os
import re
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import time
import urllib.request

import serve_process

API_KEY = "dashboard-test-key"


def fail(message):
    print("FAIL: " + message, file=sys.stderr)
    sys.exit(1)


class WebSocket:
    """RFC 6455, client side, text frames: what the DevTools protocol needs."""

    def __init__(self, url, timeout):
        m = re.match(r"ws://([^:/]+):(\d+)(/.*)", url)
        if not m:
            raise ValueError("not a ws:// URL: " + url)
        host, port, path = m.group(1), int(m.group(2)), m.group(3)
        self.sock = socket.create_connection((host, port), timeout=timeout)
        key = base64.b64encode(os.urandom(16)).decode()
        self.sock.sendall((f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nUpgrade: websocket\r\n"
                           f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\n"
                           "Sec-WebSocket-Version: 13\r\n\r\n").encode())
        response = b""
        while b"\r\n\r\n" not in response:
            chunk = self.sock.recv(4096)
            if not chunk:
                raise ConnectionError("the DevTools socket closed during the handshake")
            response += chunk
        head, self.buffer = response.split(b"\r\n\r\n", 1)
        if not head.startswith(b"HTTP/1.1 101"):
            raise ConnectionError("WebSocket handshake refused: " + head.decode(errors="replace"))

    def _read(self, n):
        while len(self.buffer) < n:
            chunk = self.sock.recv(1 << 20)
            if not chunk:
                raise ConnectionError("the DevTools socket closed")
            self.buffer += chunk
        out, self.buffer = self.buffer[:n], self.buffer[n:]
        return out

    def _send_frame(self, opcode, payload):
        header = bytes([0x80 | opcode])
        n = len(payload)
        if n < 126:
            header += bytes([0x80 | n])
        elif n < 1 << 16:
            header += bytes([0x80 | 126]) + struct.pack(">H", n)
        else:
            header += bytes([0x80 | 127]) + struct.pack(">Q", n)
        mask = os.urandom(4)
        masked = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
        self.sock.sendall(header + mask + masked)

    def send(self, text):
        self._send_frame(0x1, text.encode())

    def receive(self):
        message = b""
        while True:
            b0, b1 = self._read(2)
            opcode, n = b0 & 0x0F, b1 & 0x7F
            if n == 126:
                n = struct.unpack(">H", self._read(2))[0]
            elif n == 127:
                n = struct.unpack(">Q", self._read(8))[0]
            mask = self._read(4) if b1 & 0x80 else None
            payload = self._read(n)
            if mask:
                payload = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
            if opcode == 0x8:
                raise ConnectionError("the DevTools socket was closed by the browser")
            if opcode == 0x9:
                self._send_frame(0xA, payload)
                continue
            if opcode in (0x0, 0x1, 0x2):
                message += payload
                if b0 & 0x80:
                    return message.decode()


class Page:
    """One page target: commands by id; events are kept (script exceptions are collected)."""

    def __init__(self, ws_url):
        self.ws = WebSocket(ws_url, timeout=60)
        self.next_id = 0
        self.exceptions = []

    def call(self, method, **params):
        self.next_id += 1
        self.ws.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.receive())
            if msg.get("method") == "Runtime.exceptionThrown":
                self.exceptions.append(msg["params"]["exceptionDetails"])
            if msg.get("id") == self.next_id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg["result"]

    def evaluate(self, expression):
        r = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in r:
            raise RuntimeError(f"{expression}: {r['exceptionDetails']}")
        return r["result"].get("value")

    def wait_for(self, expression, what, timeout_s):
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            value = self.evaluate(expression)
            if value:
                return value
            time.sleep(0.2)
        fail(f"timed out after {timeout_s} s waiting for {what} ({expression})")


def find_chromium():
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


def start_server(serve, model, work):
    try:
        return serve_process.start_server(serve, ["-m", model, "-c", "256", "-np", "2", "--kv", "fp8-e4m3",
                                                  "--api-key", API_KEY], os.path.join(work, "serve.log"))
    except serve_process.ServeError as e:
        fail(str(e))


def start_chromium(chromium, work):
    profile = os.path.join(work, "profile")
    proc = subprocess.Popen([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                             "--disable-extensions", "--disable-dev-shm-usage", "--remote-debugging-port=0",
                             "--remote-debugging-address=127.0.0.1", f"--user-data-dir={profile}",
                             "--window-size=1360,900", "about:blank"],
                            stdout=subprocess.DEVNULL, stderr=open(os.path.join(work, "chromium.log"), "w"))
    active = os.path.join(profile, "DevToolsActivePort")
    deadline = time.time() + 30
    while time.time() < deadline:
        if os.path.exists(active):
            lines = open(active).read().split("\n")
            if lines and lines[0].strip().isdigit():
                port = int(lines[0])
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=5) as r:
                    targets = json.load(r)
                pages = [t for t in targets if t.get("type") == "page"]
                if pages:
                    return proc, pages[0]["webSocketDebuggerUrl"]
        if proc.poll() is not None:
            fail("chromium exited:\n" + open(os.path.join(work, "chromium.log")).read())
        time.sleep(0.1)
    fail("chromium opened no DevTools port within 30 s")


def dashboard_state(port):
    request = urllib.request.Request(f"http://127.0.0.1:{port}/dashboard/state",
                                     headers={"Authorization": "Bearer " + API_KEY})
    with urllib.request.urlopen(request, timeout=10) as r:
        return json.load(r)


# Colours of the heatmap's cells, one per (layer, head) row and step column, read off the canvas.
HEATMAP_PIXELS = """(() => {
  const c = document.getElementById('heatmap');
  const g = c.getContext('2d');
  const d = g.getImageData(0, 0, c.width, c.height).data;
  let colours = new Set(), lit = 0;
  for (let i = 0; i < d.length; i += 4) {
    const key = d[i] + ',' + d[i + 1] + ',' + d[i + 2];
    colours.add(key);
    if (key !== '11,13,16' && key !== '34,38,44' && key !== '0,0,0') lit += 1;
  }
  return {url: c.toDataURL(), lit: lit, colours: colours.size, steps: Number(c.dataset.steps || 0),
          lastStep: Number(c.dataset.lastStep || 0)};
})()"""


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--serve", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--screenshot")
    args = parser.parse_args()
    chromium = find_chromium()
    if chromium is None:
        print("SKIP: no chromium on PATH (scripts/install_deps.sh installs Debian's package)")
        return 77
    work = tempfile.mkdtemp(prefix="certkv-dashboard-")
    server = browser = None
    try:
        server, port = start_server(args.serve, args.model, work)
        browser, ws_url = start_chromium(chromium, work)
        page = Page(ws_url)
        page.call("Runtime.enable")
        page.call("Page.enable")
        page.call("Emulation.setDeviceMetricsOverride", width=1360, height=900, deviceScaleFactor=1, mobile=False)
        page.call("Page.navigate", url=f"http://127.0.0.1:{port}/")
        page.wait_for("document.readyState === 'complete' && !!document.getElementById('heatmap')", "the page", 20)

        # Without the key the page says so; with it, the numbers arrive.
        page.wait_for("document.getElementById('error').textContent.includes('API key')",
                      "the page to report the missing API key", 10)
        page.evaluate(f"""(() => {{ const k = document.getElementById('api-key');
            k.value = {json.dumps(API_KEY)}; k.dispatchEvent(new Event('change')); }})()""")
        page.wait_for("document.getElementById('model').textContent.endsWith('.gguf') && "
                      "document.getElementById('error').textContent === ''", "the dashboard's numbers", 10)
        scheme = page.evaluate("document.getElementById('scheme').textContent")
        if scheme != "fp8-e4m3":
            fail(f"the page shows KV scheme {scheme!r}, expected fp8-e4m3")
        pool = page.evaluate("document.getElementById('pool-text').textContent")
        if not re.fullmatch(r"\d+ of [1-9]\d* pages in use, \d+ cached", pool):
            fail(f"the KV pool line reads {pool!r}")
        before = page.evaluate(HEATMAP_PIXELS)
        if before["steps"] != 0:
            fail(f"the heatmap shows {before['steps']} steps before any request")

        # A chat: tokens stream into the page, then the certificate.
        page.evaluate("""(() => { document.getElementById('chat-input').value = 'Name three colours of the rainbow.';
            document.getElementById('max-tokens').value = '24';
            document.getElementById('chat-form').requestSubmit(); })()""")
        page.wait_for("(() => { const m = document.querySelector('.msg.assistant'); "
                      "return m && Number(m.dataset.tokens || 0) >= 1 && m.textContent.length > 0; })()",
                      "the first streamed token", 60)
        state = page.wait_for("(() => { const m = document.querySelector('.msg.assistant'); "
                              "return m && m.dataset.state !== 'streaming' && m.dataset.state; })()",
                              "the end of the stream", 120)
        if state != "done":
            fail("the chat ended in " + page.evaluate("document.querySelector('.msg.assistant').textContent"))
        certificate = page.evaluate("document.querySelector('.msg.assistant .cert').textContent")
        for want in ("completion tokens", "scheme fp8-e4m3", "metered true", "meter max", "coverage at tau"):
            if want not in certificate:
                fail(f"the certificate under the answer lacks {want!r}:\n{certificate}")
        tokens = int(page.evaluate("document.querySelector('.msg.assistant').dataset.tokens"))

        # The heatmap gains the chat's decode steps.
        polls = page.evaluate("Number(document.body.dataset.polls)")
        page.wait_for(f"Number(document.body.dataset.polls) >= {polls + 2}", "two more polls", 10)
        after = page.evaluate(HEATMAP_PIXELS)
        expected = dashboard_state(port)["meter"]
        steps = expected["steps"]
        if not steps:
            fail("/dashboard/state holds no metered step after the chat")
        if after["steps"] != len(steps) or after["lastStep"] != steps[-1]["step"]:
            fail(f"the heatmap shows {after['steps']} steps up to {after['lastStep']}; /dashboard/state has "
                 f"{len(steps)} up to {steps[-1]['step']}")
        # A chat of n pieces of text decodes at least n - 1 tokens after its first.
        if len(steps) < min(tokens - 1, expected["capacity"]):
            fail(f"{len(steps)} metered steps for a chat that streamed {tokens} pieces")
        rows = expected["n_layers"] * expected["n_heads"]
        for s in steps:
            if sum(v is not None for layer in s["meters"] for v in layer) != rows:
                fail(f"step {s['step']}: not every (layer, head) was metered")
        if after["url"] == before["url"] or after["lit"] < rows * len(steps):
            fail(f"the heatmap's cells did not change with the chat ({after['lit']} lit pixels, "
                 f"{rows} x {len(steps)} cells)")
        if after["colours"] < 3:
            fail(f"the heatmap has {after['colours']} colours: its cells carry no values")

        if page.exceptions:
            fail("script errors on the page: " + json.dumps(page.exceptions)[:2000])
        if args.screenshot:
            shot = page.call("Page.captureScreenshot", format="png")
            with open(args.screenshot, "wb") as f:
                f.write(base64.b64decode(shot["data"]))
            print("screenshot:", args.screenshot)
        print(f"PASS: the dashboard streamed a chat of {tokens} pieces and its heatmap shows {len(steps)} "
              f"metered steps of {expected['n_layers']} layers x {expected['n_heads']} heads")
        return 0
    finally:
        for proc in (browser, server):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
