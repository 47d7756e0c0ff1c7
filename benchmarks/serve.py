"""`deepfuse serve` under load, over loopback, against offline LLM.generate on the same workload.

A server process (`deepfuse serve`, default bf16 + int4 build) and, in this process, --concurrency
streaming clients (--client raw: a minimal HTTP/1.1 client that parses every SSE chunk's JSON;
openai: the official AsyncOpenAI, which takes several times the CPU on this 2-core machine, CPU
the server then lacks) sending --requests completions of
throughput.py's prompts (50-500 tokens, as token ids), --tokens output tokens each (EOS ignored):
  load        a --disconnect share of the clients leave their stream after a few chunks; every
              other stream must end whole (finish "length", usage of --tokens tokens, text in
              every chunk); afterwards the server must hold no KV block and run nothing (/metrics)
  throughput  fresh prompts, no client leaves: output tok/s, TTFT and TPOT p50/p99 (client side)
  offline     the throughput phase's prompts through LLM.generate in this process while the
              server idles (the same build, cache and step budget)
The throughput and offline phases alternate for --rounds rounds, each round with its own fresh
prompts (so neither finds the other's prefixes cached); the figures are medians over rounds, and
the served / offline ratio is the median of the rounds' ratios. Prints a table and writes
benchmarks/results/serve.json (--result names another file there). Bounded: --requests, and
--timeout seconds per phase.

    python benchmarks/serve.py [--requests 512] [--concurrency 64] [--disconnect 0.2] [--tokens 64] [--rounds 3]
        [--client raw] [--decode-steps 1] [--result serve.json]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import time
import urllib.request

from llama_server import free_port
from results_file import write_result
from throughput import make_prompts, pct, summary

BUILD = ["--dtype", "bf16", "--quant", "int4"]


def metrics(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        lines = r.read().decode().splitlines()
    return {ln.split()[0]: float(ln.split()[1]) for ln in lines if ln and not ln.startswith("#")}


async def raw_stream(url: str, body: dict):
    """The JSON chunks of one streamed completion, read over a plain HTTP/1.1 connection (a client
    far lighter than the openai package's, so that on this machine the load generator takes as
    little of the server's CPU as it can). Raises on a status other than 200 or a malformed body;
    closing the generator early closes the connection (the server sees the client leave)."""
    host, port = url.rsplit("//", 1)[1].split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        data = json.dumps(body).encode()
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\nConnection: close\r\n\r\n" % (host.encode(), len(data)) + data)
        status = await reader.readline()
        if status.split(b" ")[1:2] != [b"200"]:
            raise RuntimeError(f"HTTP status line {status!r}")
        chunked = False
        while (line := await reader.readline()) not in (b"\r\n", b""):
            chunked |= line.lower().startswith(b"transfer-encoding:") and b"chunked" in line.lower()
        buf = b""
        while True:
            if chunked:
                size = int((await reader.readline()).strip(), 16)
                if size == 0:
                    raise RuntimeError("the stream ended without data: [DONE]")
                buf += (await reader.readexactly(size + 2))[:-2]
            else:
                piece = await reader.read(65536)
                if not piece:
                    raise RuntimeError("the stream ended without data: [DONE]")
                buf += piece
            while b"\n\n" in buf:
                event, buf = buf.split(b"\n\n", 1)
                if not event.startswith(b"data: "):
                    raise RuntimeError(f"not an SSE data event: {event[:80]!r}")
                if event[6:] == b"[DONE]":
                    return
                yield json.loads(event[6:])
    finally:
        writer.close()


async def client_run(url: str, prompts: list[list[int]], tokens: int, concurrency: int, leave: float, seed: int,
                     client: str = "raw"):
    """Runs every prompt as a streamed completion (client "raw": raw_stream; "openai": the
    official AsyncOpenAI); returns (per-request records, wall seconds)."""
    import openai

    sdk = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
    rng = random.Random(seed)
    plan = [rng.random() < leave for _ in prompts]
    gate = asyncio.Semaphore(concurrency)

    async def chunks(i: int):
        body = dict(model="smollm2", prompt=prompts[i], max_tokens=tokens, temperature=0.8, seed=i, stream=True,
                    stream_options={"include_usage": True}, ignore_eos=True)
        if client == "raw":
            return raw_stream(url, body)
        extra = {"ignore_eos": body.pop("ignore_eos")}
        stream = await sdk.completions.create(**body, extra_body=extra)

        async def as_dicts():
            try:
                async for c in stream:
                    yield c.model_dump()
            finally:
                await stream.close()
        return as_dicts()

    async def one(i: int) -> dict:
        async with gate:
            rec = {"left": plan[i], "ok": False, "error": None}
            t0 = time.perf_counter()
            times, text, finish, usage = [], "", None, None
            try:
                stream = await chunks(i)
                async for chunk in stream:
                    if chunk.get("usage") is not None:
                        usage = chunk["usage"]
                    for c in chunk["choices"]:
                        times.append(time.perf_counter() - t0)
                        text += c["text"]
                        finish = c["finish_reason"] or finish
                    if plan[i] and len(times) >= 3:
                        await stream.aclose()
                        return rec
            except Exception as e:  # a lost or malformed response
                rec["error"] = repr(e)[:200]
                return rec
            rec["ok"] = finish == "length" and usage is not None and usage["completion_tokens"] == tokens and bool(text)
            if not rec["ok"]:
                rec["error"] = f"finish {finish}, usage {usage}, {len(text)} characters"
            rec["ttft"] = times[0] if times else float("nan")
            rec["tpot"] = (times[-1] - times[0]) / (tokens - 1) if len(times) > 1 else 0.0
            return rec

    t = time.perf_counter()
    async with sdk:  # closed inside this event loop
        records = await asyncio.gather(*[one(i) for i in range(len(prompts))])
    return records, time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=512)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--disconnect", type=float, default=0.2)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--timeout", type=float, default=1200, help="seconds per phase at most")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--decode-steps", type=int, default=1, help="decode bursts, served and offline alike (serve "
                    "--decode-steps, LLM(decode_steps=...))")
    ap.add_argument("--result", default="serve.json", help="the file under benchmarks/results/ to write")
    ap.add_argument("--client", default="raw", choices=["raw", "openai"],
                    help="raw: a minimal HTTP client (little CPU); openai: the official AsyncOpenAI")
    args = ap.parse_args()
    from deepfuse.models import resolve_model_path
    from deepfuse.models.gguf_loader import open_gguf
    from deepfuse.runtime.tokenizer import tokenizer_from_gguf

    path = resolve_model_path("smollm2")
    tok = tokenizer_from_gguf(path, open_gguf(path))
    load_prompts = make_prompts(tok, args.requests, seed=1)
    rounds = [make_prompts(tok, args.requests, seed=2 + r) for r in range(args.rounds)]
    from deepfuse import LLM, SamplingParams

    llm = LLM("smollm2", dtype="bf16", quant="int4", num_blocks=4096, max_num_seqs=64, max_num_tokens=1024,
              decode_steps=args.decode_steps)
    llm.generate(make_prompts(tok, 4, seed=3), SamplingParams(max_tokens=4), use_tqdm=False)

    def run_offline(prompts: list[list[int]]) -> dict:
        t = time.perf_counter()
        outs = llm.generate(prompts, [SamplingParams(temperature=0.8, seed=i, max_tokens=args.tokens, ignore_eos=True)
                                      for i in range(len(prompts))], use_tqdm=False)
        return summary(time.perf_counter() - t, [o.metrics.ttft_s for o in outs], [o.metrics.tpot_s for o in outs],
                       sum(len(o.outputs[0].token_ids) for o in outs))

    engine = ["--num-blocks", "4096", "--max-num-seqs", "64", "--max-num-tokens", "1024", "--decode-steps",
              str(args.decode_steps)]
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-m", "deepfuse.cli", "serve", "--port", str(port), *BUILD, *engine],
                              stderr=subprocess.DEVNULL)
    served, offline = [], []
    try:
        for _ in range(1200):  # compiling, and on a first run building the native kernels, take minutes
            if server.poll() is not None:
                raise SystemExit(f"the server exited ({server.returncode}) before it answered /health")
            try:
                urllib.request.urlopen(url + "/health", timeout=1)
                break
            except OSError:
                time.sleep(0.5)
        else:
            raise SystemExit("the server did not answer /health in 10 minutes")
        asyncio.run(client_run(url, make_prompts(tok, 4, seed=3), 4, 4, 0.0, 0, args.client))  # warm-up
        load, _ = asyncio.run(asyncio.wait_for(client_run(url, load_prompts, args.tokens, args.concurrency,
                                                          args.disconnect, 1, args.client), args.timeout))
        for _ in range(50):
            m = metrics(url)
            if m["deepfuse_num_requests_running"] == m["deepfuse_kv_cache_usage_perc"] == 0:
                break
            time.sleep(0.1)
        bad = [r for r in load if not r["left"] and not r["ok"]]
        bad_tp: list[dict] = []
        for r, prompts in enumerate(rounds):
            tp, wall = asyncio.run(asyncio.wait_for(client_run(url, prompts, args.tokens, args.concurrency, 0.0, 2,
                                                               args.client),
                                                    args.timeout))
            bad_tp += [x for x in tp if not x["ok"]]
            served.append(summary(wall, [x["ttft"] for x in tp], [x["tpot"] for x in tp],
                                  args.tokens * sum(x["ok"] for x in tp)))
            offline.append(run_offline(prompts))
            print(f"round {r + 1}: served {served[-1]['output_tps']:.1f} tok/s, offline "
                  f"{offline[-1]['output_tps']:.1f} tok/s", flush=True)
    finally:
        server.terminate()
        server.wait(30)
    left = sum(r["left"] for r in load)
    print(f"load: {len(load)} requests, {args.concurrency} at once, {left} left mid-stream, "
          f"{len(bad)} lost or malformed; after it: {m['deepfuse_num_requests_running']:.0f} running, "
          f"KV usage {m['deepfuse_kv_cache_usage_perc']:.3f}; throughput rounds: {len(bad_tp)} lost or malformed")
    for r in (bad + bad_tp)[:5]:
        print("  ", r["error"])
    ttft_load = [r["ttft"] for r in load if r.get("ttft") is not None]
    print(f"load TTFT p50 {pct(ttft_load, 0.5):.2f}s p99 {pct(ttft_load, 0.99):.2f}s")
    ratios = [a["output_tps"] / b["output_tps"] for a, b in zip(served, offline)]
    med = {name: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for name, runs in
           (("served", served), ("offline", offline))}
    print(f"\n{'run':10s} {'out tok/s':>9s} {'TTFT p50':>9s} {'TTFT p99':>9s} {'TPOT p50':>9s} {'TPOT p99':>9s}"
          f"   (medians of {args.rounds} rounds)")
    for name, r in med.items():
        print(f"{name:10s} {r['output_tps']:9.1f} {r['ttft_p50_s']:8.2f}s {r['ttft_p99_s']:8.2f}s "
              f"{1000 * r['tpot_p50_s']:7.1f}ms {1000 * r['tpot_p99_s']:7.1f}ms")
    print(f"served / offline tok/s: {statistics.median(ratios):.2f}x (rounds {', '.join(f'{x:.2f}' for x in ratios)})")
    write_result(args.result, {"decode_steps": args.decode_steps, "requests": args.requests,
                               "concurrency": args.concurrency, "disconnect": args.disconnect,
                               "tokens": args.tokens, "rounds": args.rounds, "build": BUILD,
                               "throughput_lost_or_malformed": len(bad_tp),
                               "load": {"left": left, "lost_or_malformed": len(bad),
                                        "running_after": m["deepfuse_num_requests_running"],
                                        "kv_usage_after": m["deepfuse_kv_cache_usage_perc"],
                                        "ttft_p50_s": pct(ttft_load, 0.5), "ttft_p99_s": pct(ttft_load, 0.99)},
                               "served": med["served"], "offline": med["offline"], "served_runs": served,
                               "offline_runs": offline, "served_vs_offline": statistics.median(ratios),
                               "served_vs_offline_rounds": ratios})


if __name__ == "__main__":
    main()
