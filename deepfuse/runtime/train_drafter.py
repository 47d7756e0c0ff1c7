"""Trains an MTP draft head (mtp.py) on CPU by distillation from the target's own outputs.

1. The target generates greedy continuations of the prompts (Engine, keeping Request.hidden):
   each generated token g_i comes with the hidden state h_i of the row that sampled it, exactly
   the state the head drafts from at inference.
2. The head learns g_{i+j} from (h_i, g_i, ..., g_{i+j-1}), j = 1..depth, chained through its own
   output state as when drafting (teacher-forced tokens; the copy attention sees the sequence's
   last CONTEXT tokens up to the one fed): cross-entropy over the full vocabulary
   through the target's frozen LM head, plus binary cross-entropy of the confidence head against
   "the head's argmax is the target's token".
3. A held-out tenth of the continuations calibrates the confidence head (Platt scaling) and
   measures what drafting would get: k drafts chained from the head's own tokens, counted
   until the first that differs from the target's.

    metrics = train_drafter(model, "head.safetensors", TrainConfig(seconds=180))
"""
from __future__ import annotations

import importlib
import inspect
import math
import random
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from tqdm import tqdm

from ..errors import DeepfuseError
from .kv_cache import CacheConfig
from .mtp import CONTEXT, DraftHead, extend, target_probe, target_weights

CORPUS_MODULES = (
    "argparse", "base64", "bisect", "calendar", "collections", "contextlib", "copy", "csv", "dataclasses",
    "datetime", "decimal", "difflib", "email.message", "enum", "fnmatch", "fractions", "functools", "glob",
    "gzip", "hashlib", "heapq", "http.client", "inspect", "io", "itertools", "json", "logging", "operator",
    "os.path", "pathlib", "pprint", "queue", "random", "re", "sched", "shutil", "socket", "sqlite3",
    "statistics", "string", "subprocess", "tarfile", "tempfile", "textwrap", "threading", "typing",
    "unittest", "urllib.parse", "uuid", "zipfile")
TEXT_TASKS = ("Repeat this text exactly:\n", "Rewrite this text in plain words:\n", "Summarize this text:\n",
              "Continue this text:\n", "Explain this text to a beginner:\n")
CODE_TASKS = ("Explain what this function does:\n", "Add comments to this function:\n",
              "Rewrite this function with clearer variable names:\n", "Repeat this code exactly:\n")


@dataclass(frozen=True)
class TrainConfig:
    """num_prompts continuations of max_tokens tokens are the data; training runs `steps`
    batches or `seconds`, whichever ends first (the learning rate warms up over 20 batches, then
    decays to 0 on a cosine over that budget); depth: chained head steps trained per example;
    intermediate_size: the head's MLP width (0: the target's)."""

    num_prompts: int = 256
    max_tokens: int = 96
    depth: int = 3
    steps: int = 100_000
    seconds: float = 240.0
    batch_size: int = 256
    lr: float = 2e-3
    weight_decay: float = 0.01
    intermediate_size: int = 0
    eval_drafts: int = 5
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_prompts", "max_tokens", "depth", "steps", "batch_size", "eval_drafts"):
            if getattr(self, name) < 1:
                raise DeepfuseError(f"TrainConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.seconds <= 0 or self.lr <= 0:
            raise DeepfuseError("TrainConfig.seconds and lr must be > 0")


def corpus_prompts(tokenizer, n: int, seed: int = 0) -> list[list[int]]:
    """n prompts from the Python standard library's docstrings and sources (text on every
    machine): chat requests to repeat, rewrite, summarise or explain a passage or a function,
    and raw code continuations."""
    passages, functions = [], []
    for name in CORPUS_MODULES:
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        for _, obj in sorted(vars(mod).items()):
            if getattr(obj, "__module__", None) != mod.__name__:
                continue
            doc = inspect.getdoc(obj) or ""
            para = doc.split("\n\n")[0]
            if 120 <= len(para) <= 700:
                passages.append(para)
            if inspect.isfunction(obj):
                try:
                    src = inspect.getsource(obj)
                except (OSError, TypeError):
                    continue
                if 5 <= src.count("\n") <= 30:
                    functions.append(src)
    if not passages or not functions:
        raise DeepfuseError("found no standard-library text to build prompts from; pass prompts instead")
    rng = random.Random(seed)
    out = []
    for i in range(n):
        kind = i % 3
        if kind == 0:
            text = rng.choice(TEXT_TASKS) + rng.choice(passages)
        elif kind == 1:
            text = rng.choice(CODE_TASKS) + "```python\n" + rng.choice(functions) + "```"
        else:
            src = rng.choice(functions)
            out.append(tokenizer.encode(src[: max(40, len(src) // 2)]))
            continue
        out.append(tokenizer.encode(tokenizer.render_chat([{"role": "user", "content": text}])))
    return out


def greedy_states(model, prompts: list[list[int]], max_tokens: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per prompt: the target's greedy continuation g [n] i64 and the hidden states h [n,D] f32
    that sampled each of its tokens (Request.hidden after each step)."""
    from .engine import Engine, SamplingParams

    eng = Engine(model, CacheConfig(16, 4096), max_num_tokens=512, max_num_seqs=64)
    eng.keep_hidden = True
    ids = [eng.add_request(p, SamplingParams(temperature=0, max_tokens=max_tokens)) for p in prompts]
    requests = {i: eng.requests[i] for i in ids}  # a finished request leaves eng.requests before its last token streams
    got: dict[str, list] = {i: [] for i in ids}

    def record(rid: str, token: int) -> None:
        got[rid].append((requests[rid].hidden, token))

    with tqdm(total=len(ids), desc="generating", unit="req", leave=False) as bar:
        while eng.has_unfinished():
            bar.update(len(eng.step(record)))
    return [(torch.tensor([t for _, t in got[i]]), torch.stack([h for h, _ in got[i]])) for i in ids]


class Examples:
    """Flat arrays over the continuations: g [P] tokens, h [P,D] the state that sampled each,
    and every sequence's tokens (prompt + continuation) for the copy attention's context;
    `starts` are indices i with i + depth in the same continuation. An example at i drafts from
    (h_i, g_i) and should predict g_{i+1}, then g_{i+2}, ... (the target's greedy path)."""

    def __init__(self, prompts: list[list[int]], states: list[tuple[torch.Tensor, torch.Tensor]], depth: int):
        self.g = torch.cat([g for g, _ in states])
        self.h = torch.cat([h for _, h in states])
        self.tok = torch.tensor([t for p, (g, _) in zip(prompts, states) for t in p + g.tolist()], dtype=torch.long)
        gpos, first, starts, a, b = [], [], [], 0, 0
        for p, (g, _) in zip(prompts, states):
            gpos += range(b + len(p), b + len(p) + len(g))  # where each g sits in tok
            first += [b] * len(g)
            starts += range(a, a + len(g) - depth)
            a, b = a + len(g), b + len(p) + len(g)
        self.gpos, self.first = torch.tensor(gpos, dtype=torch.long), torch.tensor(first, dtype=torch.long)
        self.starts = torch.tensor(starts, dtype=torch.long)

    def batch(self, idx: torch.Tensor, depth: int):
        """idx [N] into starts -> h [N,D], x [N,depth] (the tokens fed), y [N,depth] (the targets),
        ctx [N,depth,CONTEXT] (the context each fed token ends; -1 before its sequence)."""
        i = self.starts[idx]
        js = i[:, None] + torch.arange(depth + 1)
        cols = (self.gpos[i][:, None] + torch.arange(depth))[..., None] - CONTEXT + 1 + torch.arange(CONTEXT)
        ctx = self.tok[cols.clamp(min=0)].masked_fill(cols < self.first[i][:, None, None], -1)
        return self.h[i], self.g[js[:, :-1]], self.g[js[:, 1:]], ctx


def head_loss(head, embed, lm_head, h, x, y, ctx):
    """Mean cross-entropy over the chained depths + the confidence head's BCE; also top-1 accuracy."""
    loss, correct = 0.0, 0.0
    for j in range(x.shape[1]):
        logits, h, conf = head(h, x[:, j], ctx[:, j], embed, lm_head)
        hit = (logits.argmax(-1) == y[:, j]).float()
        loss = loss + F.cross_entropy(logits, y[:, j]) + F.binary_cross_entropy_with_logits(conf, hit)
        correct += float(hit.mean())
    return loss / x.shape[1], correct / x.shape[1]


@torch.inference_mode()
def chained_drafts(head, embed, lm_head, examples: Examples, k: int):
    """Drafting as at inference on every example: k drafts chained from the head's own tokens
    and context. -> (drafts [P,k], confidence logits [P,k], the target's tokens [P,k])."""
    drafts, conf, want = [torch.zeros(0, k, dtype=torch.long)], [torch.zeros(0, k)], [torch.zeros(0, k, dtype=torch.long)]
    for a in range(0, len(examples.starts), 512):
        h, x, y, ctx = examples.batch(torch.arange(a, min(a + 512, len(examples.starts))), k)
        x, ctx, ds, cs = x[:, 0], ctx[:, 0], [], []
        for _ in range(k):
            logits, h, c = head(h, x, ctx, embed, lm_head)
            x = logits.argmax(-1)
            ctx = extend(ctx, x)
            ds.append(x)
            cs.append(c)
        drafts.append(torch.stack(ds, 1))
        conf.append(torch.stack(cs, 1))
        want.append(y)
    return torch.cat(drafts), torch.cat(conf), torch.cat(want)


def drafting_metrics(drafts, conf, want) -> dict:
    """Accepted = drafts before the first that differs from the target's greedy tokens; also
    the first draft's mean confidence (sigmoid of conf) vs its accuracy."""
    if len(drafts) == 0:
        return {}
    k = drafts.shape[1]
    n = (drafts == want).long().cumprod(1).sum(1).float()
    return {"positions": len(n), "drafts": k, "acceptance_rate": float(n.mean() / k),
            "mean_accepted_length": float(n.mean() + 1),
            "first_draft_accuracy": float((drafts[:, 0] == want[:, 0]).float().mean()),
            "first_draft_mean_confidence": float(torch.sigmoid(conf[:, 0]).mean())}


def evaluate(head, embed, lm_head, examples: Examples, k: int) -> dict:
    """drafting_metrics of the head's chained drafts on `examples`."""
    return drafting_metrics(*chained_drafts(head, embed, lm_head, examples, k))


def calibrate(head, drafts, conf, want, steps: int = 200) -> tuple[float, float]:
    """Platt scaling of the confidence head on held-out chained drafts: fits a, b so that
    sigmoid(a * c + b) is the chance draft j is right given drafts 1..j-1 were, folds them into
    head.conf and returns them. Training on seen data leaves the head over-confident; the
    schedule needs honest probabilities."""
    hit = (drafts == want).float()
    alive = torch.cat([torch.ones_like(hit[:, :1]), hit.cumprod(1)[:, :-1]], 1).bool()  # drafts before all right
    c, y = conf[alive], hit[alive]
    if len(y) == 0 or y.min() == y.max():
        return 1.0, 0.0  # nothing to fit against
    ab = torch.tensor([1.0, 0.0], requires_grad=True)
    opt = torch.optim.LBFGS([ab], max_iter=steps)

    def closure():
        opt.zero_grad()
        loss = F.binary_cross_entropy_with_logits(ab[0] * c + ab[1], y)
        loss.backward()
        return loss

    opt.step(closure)
    a, b = (float(v) for v in ab.detach())
    with torch.no_grad():
        head.conf.weight.mul_(a)
        head.conf.bias.mul_(a).add_(b)
    return a, b


def train_drafter(model, out_path: str, config: TrainConfig = TrainConfig(),
                  prompts: list[list[int]] | None = None, log=print) -> dict:
    """Generates data with `model` (a CompiledModel), trains a DraftHead, saves it to out_path
    and returns its metrics (also stored in the file)."""
    if model.tokenizer is None and prompts is None:
        raise DeepfuseError("this model has no tokenizer: pass prompts as token ids")
    torch.manual_seed(config.seed)
    t0 = time.perf_counter()
    prompts = prompts if prompts is not None else corpus_prompts(model.tokenizer, config.num_prompts, config.seed)
    limit = model.config.max_position - config.max_tokens  # a long prompt keeps its end
    prompts = [p[-limit:] for p in prompts]
    log(f"generating {len(prompts)} greedy continuations of up to {config.max_tokens} tokens")
    states = greedy_states(model, prompts, config.max_tokens)
    t_data = time.perf_counter() - t0
    order = list(range(len(states)))
    random.Random(config.seed).shuffle(order)
    n_eval = max(1, len(states) // 10) if len(states) > 1 else 0
    pick = lambda ids: ([prompts[i] for i in ids], [states[i] for i in ids])
    train_set = Examples(*pick(order[n_eval:]), config.depth)
    held = Examples(*pick(order[:n_eval]), config.eval_drafts)
    if len(train_set.starts) == 0:
        raise DeepfuseError(f"continuations are too short for depth {config.depth}: raise max_tokens")

    embed, lm_head = target_weights(model)
    c = model.config
    head = DraftHead(c.hidden_size, config.intermediate_size or c.intermediate_size, c.vocab_size, c.rms_norm_eps)
    before = evaluate(head.eval(), embed, lm_head, held, config.eval_drafts)
    opt = torch.optim.AdamW(head.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    gen = torch.Generator().manual_seed(config.seed)
    log(f"training on {len(train_set.starts)} positions ({len(states) - n_eval} continuations), depth "
        f"{config.depth}; {n_eval} continuations held out")
    flush = torch.set_flush_denormal(True)  # softmax gradients underflow: denormal matmuls are ~15x slower
    head.train()
    steps, t_train, losses = 0, time.perf_counter(), []
    try:
        with tqdm(total=config.steps if config.steps < 100_000 else None, desc="training", unit="step",
                  leave=False) as bar:
            while steps == 0 or (steps < config.steps and time.perf_counter() - t_train < config.seconds):
                idx = torch.randint(len(train_set.starts), (config.batch_size,), generator=gen)
                done = max(steps / config.steps, (time.perf_counter() - t_train) / config.seconds)
                lr = config.lr * min(1.0, (steps + 1) / 20) * 0.5 * (1 + math.cos(math.pi * min(done, 1.0)))
                for group in opt.param_groups:
                    group["lr"] = lr
                loss, acc = head_loss(head, embed, lm_head, *train_set.batch(idx, config.depth))
                opt.zero_grad()
                loss.backward()
                opt.step()
                losses.append(loss.item())
                steps += 1
                bar.update()
                bar.set_postfix(loss=f"{loss.item():.3f}", top1=f"{acc:.2f}")
    finally:
        if flush:
            torch.set_flush_denormal(False)
    head.eval()
    drafts, conf, want = chained_drafts(head, embed, lm_head, held, config.eval_drafts)
    uncalibrated = drafting_metrics(drafts, conf, want).get("first_draft_mean_confidence")
    a, b = calibrate(head, drafts, conf, want)
    after = drafting_metrics(drafts, a * conf + b, want)  # calibration changes the confidences, not the drafts
    metrics = {"config": asdict(config), "sequences": len(states), "train_positions": len(train_set.starts),
               "steps": steps, "data_seconds": round(t_data, 1),
               "train_seconds": round(time.perf_counter() - t_train, 1),
               "first_loss": losses[0], "last_loss": sum(losses[-10:]) / len(losses[-10:]),
               "heldout_untrained": before, "heldout": after, "uncalibrated_first_confidence": uncalibrated}
    if not all(map(math.isfinite, losses)):
        raise DeepfuseError("training diverged (non-finite loss); lower the learning rate")
    head.save(out_path, target_probe(lm_head), metrics)
    return metrics
