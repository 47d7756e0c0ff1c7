"""Step latency: LatencyModel, step time (ms) by (sequences, tokens) in the step, which
confidence-scheduled speculative decoding (spec.choose_drafts) plans with, and
measure_latency, which fills one for an Engine (or reads it from the on-disk cache)."""
from __future__ import annotations

import bisect
import hashlib
import itertools
import json
import os
import time

import torch

from ..codegen.cpu import native
from .batch import SeqChunk

LATENCY_CONTEXT = 128  # tokens each sequence has cached in the latency table's measured steps


class LatencyModel:
    """Step time (ms) by (sequences in the step, tokens in the step). Sixteen sequences of
    one token cost far more than one sequence of sixteen (each sequence attends over its own
    cache), so the model is a grid: a row of measured points per sequence count, piecewise
    linear in tokens (beyond a row's last point, at its last slope; below its first, its
    first value), and linear between rows. observe() moves the points a measured step was
    predicted from toward it, each by its share of the interpolation."""

    def __init__(self, points: dict[tuple[int, int], float]):
        rows: dict[int, dict[int, float]] = {}
        for (s, t), ms in points.items():
            rows.setdefault(s, {})[t] = ms
        self.seqs = sorted(rows)
        self.tokens = [sorted(rows[s]) for s in self.seqs]
        # more tokens never take less time: a measured dip is noise
        self.ms = [list(itertools.accumulate((rows[s][t] for t in ts), max)) for s, ts in zip(self.seqs, self.tokens)]

    @staticmethod
    def _between(xs: list[int], x: float, extend: bool) -> tuple[int, int, float]:
        """The two points of xs around x and x's fraction of the way from the first to the
        second (past the last point: > 1 when extend, else clamped; below the first: 0)."""
        if len(xs) == 1 or x <= xs[0]:
            return 0, 0, 0.0
        i = min(bisect.bisect_left(xs, x), len(xs) - 1)
        f = (x - xs[i - 1]) / (xs[i] - xs[i - 1])
        return i - 1, i, f if extend else min(f, 1.0)

    def _terms(self, seqs: int, tokens: int) -> list[tuple[int, int, float]]:
        """(row, point, weight) whose weighted sum of ms is the prediction."""
        r0, r1, fs = self._between(self.seqs, seqs, extend=False)
        out = []
        for r, wr in ((r0, 1 - fs), (r1, fs)):
            p0, p1, ft = self._between(self.tokens[r], tokens, extend=True)
            out += [(r, p0, wr * (1 - ft)), (r, p1, wr * ft)]
        return out

    def predict(self, seqs: int, tokens: int) -> float:
        return max(sum(w * self.ms[r][p] for r, p, w in self._terms(seqs, tokens)), 1e-3)

    def observe(self, seqs: int, tokens: int, ms: float, weight: float = 0.1) -> None:
        err = ms - self.predict(seqs, tokens)
        terms = [(r, p, min(max(w, 0.0), 1.0)) for r, p, w in self._terms(seqs, tokens)]
        total = sum(w for _, _, w in terms)
        for r, p, w in terms:
            self.ms[r][p] += weight * err * w / total

    def to_json(self) -> list[list[float]]:
        return [[s, t, m] for s, ts, ms in zip(self.seqs, self.tokens, self.ms) for t, m in zip(ts, ms)]

    def save(self, path: str) -> None:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            json.dump(self.to_json(), f)

    @staticmethod
    def load(path: str) -> LatencyModel | None:
        try:
            with open(path) as f:
                return LatencyModel({(int(s), int(t)): float(m) for s, t, m in json.load(f)})
        except (OSError, ValueError, TypeError):
            return None


def measure_latency(engine) -> LatencyModel:
    """An Engine's step time by (sequences, tokens), for confidence scheduling: read from the on-disk
    cache (keyed by the compiled plan, dtype, native kernels, threads, cache and batch sizes, and whether
    decode steps are graphed) or measured now on throwaway blocks: S = 1, 2, 4, ..., max_num_seqs
    sequences of n = 1, 2, 4, 8 tokens each continuing a LATENCY_CONTEXT-token sequence (a verify
    step's shape), and one sequence of up to max_num_tokens (a prefill chunk's); each step as the
    engine runs it (Engine.forward), up to its tokens on the host."""
    sc = engine.scheduler.config
    kernels = native.fingerprint() if engine.model.target == "cpu" else ""
    key = hashlib.sha256(json.dumps(["grid", engine.model.plan, engine.model.dtype, kernels, torch.get_num_threads(),
                                     engine.cache.block_size, engine.cache.config.num_blocks, sc.max_num_seqs,
                                     sc.max_num_tokens, *(["graphed"] if engine.graphed is not None else [])],
                                    sort_keys=True, default=str).encode()).hexdigest()[:20]
    path = os.path.join(os.path.expanduser("~"), ".cache", "deepfuse", "latency", key + ".json")
    cached = LatencyModel.load(path)
    if cached is not None:
        return cached
    budget, bs = engine.scheduler.config.max_num_tokens, engine.cache.block_size
    free = min(pool.num_available() for pool in engine.cache.pools)

    def start_of(s: int, n: int) -> int:
        """Where each of s measured chunks of n tokens starts: a verify chunk continues a
        LATENCY_CONTEXT-token sequence (shorter where the free blocks cannot hold s of
        those), a prefill chunk starts at 0; -1 where even that does not fit."""
        fit = (free // s) * bs - n
        return min(LATENCY_CONTEXT, engine.max_model_len - n, fit) if n <= 8 else (0 if fit >= 0 else -1)

    shapes = [(1, t) for t in (16, 32, 64, 128, 256, 512) if t <= min(budget, engine.max_model_len)]
    rows = sorted({s for s in (1, 2, 4, 8, 16, 32, 64, 128) if s < sc.max_num_seqs} | {sc.max_num_seqs})
    shapes += [(s, s * n) for s in rows for n in (1, 2, 4, 8) if s * n <= budget]
    shapes = [(s, t) for s, t in shapes if start_of(s, t // s) >= 0] or [(1, 1)]
    points = {}
    for s, t in sorted(set(shapes)):
        n = t // s
        start = max(start_of(s, n), 0)
        seqs = [engine.kv.new_seq([]) for _ in range(s)]
        try:
            for q in seqs:
                engine.kv.reserve(q, start + n)
            chunks = [SeqChunk.of(q, [0] * n, start, samples=n if n <= 8 else 1) for q in seqs]
            times = []
            for _ in range(3):
                t0 = time.perf_counter()
                engine.forward(chunks)[1][1].tolist()  # as a step: decode in its bucket, waits for the tokens
                times.append((time.perf_counter() - t0) * 1000)
            points[s, t] = sorted(times)[1]
        finally:
            for q in seqs:
                engine.kv.free(q)
    model = LatencyModel(points)
    model.save(path)
    return model
