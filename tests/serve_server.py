"""A `samebits serve` subprocess on 127.0.0.1 for the serve tests, stopped by its PID."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

READY_TIMEOUT = 180


class Server:
    def __init__(self, model: Path, *extra: str):
        src = str(Path(__file__).parents[1] / "src")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")])))
        cmd = [sys.executable, "-m", "samebits.cli", "serve", "--model", str(model), "--port", "0", *extra]
        self.proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
        lines: queue.Queue = queue.Queue()

        def pump():
            for x in self.proc.stderr:
                lines.put(x)
            lines.put(None)  # the server's stderr closed: it exited

        threading.Thread(target=pump, daemon=True).start()
        deadline, seen = time.monotonic() + READY_TIMEOUT, []
        while True:
            try:
                line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                self.proc.kill()
                raise AssertionError(
                    f"server not ready in {READY_TIMEOUT} s; its stderr:\n{''.join(seen)}"
                ) from None
            if line is None:
                raise AssertionError(
                    f"server exited ({self.proc.wait()}) before ready; its stderr:\n{''.join(seen)}"
                )
            seen.append(line)
            if "ready on http://" in line:
                self.url = line.split("ready on ")[1].split()[0]
                break
        self.model = model.name

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=30)

    def rss_kib(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise AssertionError("no VmRSS")

    def metric(self, name: str) -> float:
        for line in httpx.get(f"{self.url}/metrics").text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        raise AssertionError(f"no metric {name}")
