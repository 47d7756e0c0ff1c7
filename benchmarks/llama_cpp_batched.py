"""llama.cpp serving many sequences at once, as its server's parallel slots do: one context with
n_seq_max sequences (a KV stream each, or one unified cache), prompts prefilled packed into
batches of n_batch tokens, then one llama_decode per step for every running sequence, greedy by
llama.cpp's sampler. Through llama-cpp-python's low-level bindings (the `bench` extra): the same
batched decode llama-server runs for its slots, without the HTTP layer."""
from __future__ import annotations

import time


class LlamaCppParallel:
    """llama.cpp serving many sequences at once on one context with a unified KV cache (n_seq_max
    sequences): every prompt prefilled, packed into batches of n_batch tokens with logits only at
    each prompt's last token, then one llama_decode per step holding every sequence's next
    token; tokens picked by llama.cpp's greedy sampler."""

    def __init__(self, llm, n_seq: int, n_ctx: int, n_batch: int = 512, unified: bool = True):
        import ctypes

        import llama_cpp as lc

        self.lc, self.n_batch = lc, n_batch
        params = lc.llama_context_params()
        ctypes.pointer(params)[0] = llm.context_params  # the batch-1 context's settings (threads, ...)
        params.n_ctx, params.n_batch, params.n_ubatch, params.n_seq_max = n_ctx, n_batch, n_batch, n_seq
        params.kv_unified = unified  # False: one KV stream of n_ctx / n_seq cells per sequence
        self.ctx = lc.llama_init_from_model(llm.model, params)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not make a context for parallel sequences")
        self.batch = lc.llama_batch_init(max(n_batch, n_seq), 0, 1)
        self.sampler = lc.llama_sampler_init_greedy()

    def decode(self, items: list[tuple[int, int, int, bool]]) -> None:
        """items: (token, position, sequence, logits wanted)."""
        b = self.batch
        for i, (t, pos, s, out) in enumerate(items):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = t, pos, 1, out
            b.seq_id[i][0] = s
        b.n_tokens = len(items)
        rc = self.lc.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")

    def run(self, prompts: list[list[int]], n: int) -> tuple[float, list[list[float]]]:
        """(start, each sequence's token times) for n greedy tokens of every prompt, EOS ignored."""
        lc = self.lc
        lc.llama_memory_clear(lc.llama_get_memory(self.ctx), True)
        start = time.perf_counter()
        times: list[list[float]] = [[] for _ in prompts]
        last, pos = {}, [len(p) for p in prompts]
        pending = [(t, i, s, i == len(p) - 1) for s, p in enumerate(prompts) for i, t in enumerate(p)]
        for c in range(0, len(pending), self.n_batch):
            chunk = pending[c:c + self.n_batch]
            self.decode(chunk)
            for i, (_, _, s, out) in enumerate(chunk):
                if out:
                    last[s] = lc.llama_sampler_sample(self.sampler, self.ctx, i)
                    times[s].append(time.perf_counter())
        seqs = sorted(last)
        for _ in range(n - 1):
            self.decode([(last[s], pos[s], s, True) for s in seqs])
            for i, s in enumerate(seqs):
                last[s] = lc.llama_sampler_sample(self.sampler, self.ctx, i)
                pos[s] += 1
                times[s].append(time.perf_counter())
        return start, times
