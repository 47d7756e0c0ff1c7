"""The server's /metrics: Prometheus text exposition of the engine's gauges (requests running
and waiting, KV usage, prefix hit rate), counters (tokens, requests, speculative drafts),
tokens/s over the last seconds, and latency histograms (TTFT, TPOT, end to end).

Histograms are fed on the engine thread (AsyncLLM's on_finish); rendering reads them under a
lock from the server's thread. Owns no engine state: engine figures come from AsyncLLM.stats().
"""
from __future__ import annotations

import bisect
import threading

from ..runtime.async_llm import RATE_WINDOW_S, EngineStats
from ..runtime.outputs import RequestOutput

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class Histogram:
    def __init__(self, name: str, help: str, buckets: tuple[float, ...]):
        self.name, self.help, self.buckets = name, help, buckets
        self.counts = [0] * (len(buckets) + 1)  # the last: above every bucket
        self.sum = 0.0

    def observe(self, v: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, v)] += 1
        self.sum += v

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        total = 0
        for le, c in zip((*map(repr, self.buckets), "+Inf"), self.counts):
            total += c
            lines.append(f'{self.name}_bucket{{le="{le}"}} {total}')
        return lines + [f"{self.name}_sum {self.sum!r}", f"{self.name}_count {total}"]


class ServerMetrics:
    def __init__(self):
        self.lock = threading.Lock()
        self.ttft = Histogram("deepfuse_time_to_first_token_seconds", "Seconds from arrival to the first token.",
                              TTFT_BUCKETS)
        self.tpot = Histogram("deepfuse_time_per_output_token_seconds",
                              "Mean seconds per output token after the first, per request.", TPOT_BUCKETS)
        self.e2e = Histogram("deepfuse_e2e_request_latency_seconds", "Seconds from arrival to the end.", E2E_BUCKETS)
        self.finished: dict[str, int] = {}

    def on_finish(self, out: RequestOutput) -> None:
        """Records a finished request (engine thread)."""
        with self.lock:
            m = out.metrics
            if m is not None and any(c.token_ids for c in out.outputs):
                self.ttft.observe(m.ttft_s)
                if any(len(c.token_ids) > 1 for c in out.outputs):
                    self.tpot.observe(m.tpot_s)
                self.e2e.observe(m.total_s)
            for c in out.outputs:
                self.finished[c.finish_reason] = self.finished.get(c.finish_reason, 0) + 1

    def render(self, s: EngineStats) -> str:
        rate = s.spec_accepted / s.spec_drafted if s.spec_drafted else 0.0
        gauges = [
            ("deepfuse_num_requests_running", "Requests in the running batch.", s.running),
            ("deepfuse_num_requests_waiting", "Requests waiting to be scheduled.", s.waiting),
            ("deepfuse_kv_cache_usage_perc", "Fraction of KV blocks held by requests (0-1).", s.kv_usage),
            ("deepfuse_prefix_cache_hit_rate", "Prompt blocks found in the prefix cache, of those looked up (0-1).",
             s.prefix_hit_rate),
            ("deepfuse_generation_tokens_per_second", f"Output tokens/s over the last {RATE_WINDOW_S:g} s.",
             s.tokens_per_s),
            ("deepfuse_spec_decode_acceptance_rate", "Accepted draft tokens of those verified (0-1).", rate),
        ]
        counters = [
            ("deepfuse_prompt_tokens_total", "Prompt tokens computed (not from the prefix cache).", s.prompt_tokens),
            ("deepfuse_generation_tokens_total", "Output tokens generated.", s.generated_tokens),
            ("deepfuse_engine_steps_total", "Engine steps run.", s.steps),
            ("deepfuse_spec_decode_num_draft_tokens_total", "Draft tokens verified.", s.spec_drafted),
            ("deepfuse_spec_decode_num_accepted_tokens_total", "Draft tokens accepted.", s.spec_accepted),
        ]
        lines = []
        for name, help, v in gauges:
            lines += [f"# HELP {name} {help}", f"# TYPE {name} gauge", f"{name} {float(v)!r}"]
        for name, help, v in counters:
            lines += [f"# HELP {name} {help}", f"# TYPE {name} counter", f"{name} {v}"]
        with self.lock:
            name = "deepfuse_request_success_total"
            lines += [f"# HELP {name} Finished completions by finish reason.", f"# TYPE {name} counter"]
            lines += [f'{name}{{finished_reason="{r}"}} {c}' for r, c in sorted(self.finished.items())]
            for h in (self.ttft, self.tpot, self.e2e):
                lines += h.render()
        return "\n".join(lines) + "\n"
