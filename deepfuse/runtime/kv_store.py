"""KV storage tier: full prefix-cache blocks kept on disk, so a prefix computed once is found
again after the memory cache evicted it, or after a restart.

A directory holds `store.json` (format version and the fingerprint of the model, dtype and cache
layout that wrote it) and one file per block, named by the block's prefix hash (kv_cache.block_hash):

    magic b"DFKV" | u32 format | 16-byte name | u64 payload bytes | 16-byte blake2b(payload) | payload

where the payload is the block's rows in every layer of cache group 0 ([2, BS, Hkv, row] each, in
layer order). Blocks are written after the step that computed them completes, by a background
thread from a copy taken then (the step loop never waits on the disk), to a temporary file
renamed into place, so a crash leaves whole files or none. The store keeps at most `max_bytes`,
dropping least recently used files. Reading checks the header and checksum: a truncated or
corrupt file is deleted and its block recomputed, never read into the cache. A directory written
for another model, dtype, block size or format is refused: nothing in it is read or written.
"""
from __future__ import annotations

import atexit
import hashlib
import json
import os
import queue
import struct
import threading
import warnings
from collections import OrderedDict

import torch

FORMAT = 1
MAGIC = b"DFKV"
HEADER = struct.Struct("<4sI16sQ16s")


def model_fingerprint(model, block_size: int) -> str:
    """What makes two engines' KV interchangeable: family config, dtypes, quantization, target,
    batch invariance, cache row type and block size, and every weight's bytes."""
    h = hashlib.blake2b(digest_size=16)
    desc = {"config": model.config.to_dict(), "dtype": model.dtype, "quant": model.quant, "target": model.target,
            "batch_invariant": model.batch_invariant, "kv": str(model.kv_cache_type), "block_size": block_size}
    h.update(json.dumps(desc, sort_keys=True, default=str).encode())
    for name in sorted(model.graph.weights):
        w = model.graph.weights[name].detach().contiguous().cpu()
        h.update(name.encode() + str(tuple(w.shape)).encode() + str(w.dtype).encode())
        h.update(w.view(torch.uint8).numpy().tobytes() if w.numel() else b"")
    return h.hexdigest()


class DiskKVStore:
    """Blocks on disk by name. has(name) and load(name, into) run on the engine's thread;
    put(name, data) only queues the write."""

    def __init__(self, directory: str, max_bytes: int, fingerprint: str):
        self.dir, self.max_bytes, self.fingerprint = directory, max_bytes, fingerprint
        self.files: OrderedDict[bytes, int] = OrderedDict()  # name -> file bytes, least recently used first
        self.bytes = 0
        self.enabled = True
        self.write_errors = 0
        self.dropped_corrupt = 0
        self.loaded = 0
        self._lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue()
        os.makedirs(directory, exist_ok=True)
        meta = os.path.join(directory, "store.json")
        want = {"format": FORMAT, "fingerprint": fingerprint}
        if os.path.exists(meta):
            try:
                with open(meta) as f:
                    have = json.load(f)
            except (OSError, ValueError):
                have = None
            if have != want:
                warnings.warn(f"KV store {directory} was written for another model, dtype, block size or format "
                              f"({have}); it is not used", stacklevel=2)
                self.enabled = False
                return
        else:
            with open(meta + ".tmp", "w") as f:
                json.dump(want, f)
            os.replace(meta + ".tmp", meta)
        entries = []
        for entry in os.scandir(directory):
            if entry.name.endswith(".kv") and len(entry.name) == 35:
                st = entry.stat()
                entries.append((st.st_mtime, bytes.fromhex(entry.name[:32]), st.st_size))
            elif entry.name.endswith(".kv.tmp"):  # a write a crash interrupted
                os.unlink(entry.path)
        for _, name, size in sorted(entries):
            self.files[name] = size
            self.bytes += size
        self._writer = threading.Thread(target=self._write_loop, name="kv-store-writer", daemon=True)
        self._writer.start()
        atexit.register(self.flush)  # blocks queued when the process ends are written first

    def path(self, name: bytes) -> str:
        return os.path.join(self.dir, name.hex() + ".kv")

    def has(self, name: bytes) -> bool:
        with self._lock:
            return self.enabled and name in self.files

    def put(self, name: bytes, payload: bytes) -> None:
        """Queues a block's bytes for writing (a name already stored is skipped)."""
        if self.enabled and not self.has(name):
            self._queue.put((name, payload))

    def load(self, name: bytes) -> bytes | None:
        """The block's payload, or None where the file is missing, truncated or corrupt (it is then dropped)."""
        try:
            with open(self.path(name), "rb") as f:
                raw = f.read()
        except OSError:
            raw = b""
        payload = self._check(name, raw)
        with self._lock:
            if payload is None:
                self._drop(name)
                self.dropped_corrupt += 1
                return None
            if name in self.files:
                self.files.move_to_end(name)
            self.loaded += 1
        return payload

    @staticmethod
    def _check(name: bytes, raw: bytes) -> bytes | None:
        if len(raw) < HEADER.size:
            return None
        magic, version, stored, length, digest = HEADER.unpack_from(raw)
        payload = raw[HEADER.size:]
        if magic != MAGIC or version != FORMAT or stored != name or length != len(payload):
            return None
        return payload if hashlib.blake2b(payload, digest_size=16).digest() == digest else None

    def flush(self) -> None:
        """Waits until every queued block is written (or failed)."""
        if self.enabled:
            self._queue.join()

    def _write_loop(self) -> None:
        while True:
            name, payload = self._queue.get()
            try:
                self._write(name, payload)
            finally:
                self._queue.task_done()

    def _write(self, name: bytes, payload: bytes) -> None:
        data = HEADER.pack(MAGIC, FORMAT, name, len(payload), hashlib.blake2b(payload, digest_size=16).digest()) + payload
        if len(data) > self.max_bytes:
            return
        with self._lock:
            while self.files and self.bytes + len(data) > self.max_bytes:
                self._drop(next(iter(self.files)))
        tmp = self.path(name) + ".tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, self.path(name))
        except OSError as e:  # a full disk, say: the block stays in memory only
            self.write_errors += 1
            if self.write_errors == 1:
                warnings.warn(f"KV store {self.dir}: writing a block failed ({e}); blocks that do not fit stay "
                              "in memory only", stacklevel=2)
            try:
                os.unlink(tmp)
            except OSError:
                pass
            return
        with self._lock:
            self.files[name] = len(data)
            self.bytes += len(data)

    def _drop(self, name: bytes) -> None:
        """Removes a block's file (the lock is held)."""
        size = self.files.pop(name, None)
        if size is not None:
            self.bytes -= size
        try:
            os.unlink(self.path(name))
        except OSError:
            pass
