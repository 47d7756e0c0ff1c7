"""Trains an MTP draft head (mtp.py) on CPU by distillation from the target's own outputs.

1. The target generates greedy continuations of the prompts (Engine).
2. One pass over each prompt + continuation, every row sampled, gives per position t the
   target's hidden state h_t and its greedy next token y_t.
3. The head learns y_{t+j} from (h_t, x_{t+1}, ..., x_{t+j}), j = 1..depth, chained through its
   own output state as at drafting time (teacher-forced tokens x): cross-entropy over the full
   vocabulary through the target's frozen LM head, plus binary cross-entropy of the confidence
   head against "the head's argmax is y".
4. A held-out tenth of the sequences measures what drafting would get: on generated text (where
   the target's greedy path is known), k drafts chained from the head's own tokens, counted
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
from ..ir import DTYPES
from .batch import SeqChunk, build_step
from .kv_cache import CacheConfig, KVCache
from .mtp import DraftHead, target_probe, target_weights

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
    batches or `seconds`, whichever ends first; depth: chained head steps trained per example;
    intermediate_size: the head's MLP width (0: the target's)."""

    num_prompts: int = 128
    max_tokens: int = 96
    depth: int = 3
    steps: int = 100_000
    seconds: float = 180.0
    batch_size: int = 256
    lr: float = 1e-3
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


def continue_greedily(model, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """prompt + the target's greedy continuation, per prompt."""
    from .engine import Engine, SamplingParams

    eng = Engine(model, CacheConfig(16, 4096), max_num_tokens=512, max_num_seqs=64)
    outs = eng.generate(prompts, [SamplingParams(temperature=0, max_tokens=max_tokens)] * len(prompts),
                        use_tqdm=True)
    bad = [o.error for o in outs if o.error is not None]
    if bad:
        raise DeepfuseError(f"{len(bad)} prompts could not run: {bad[0]}")
    return [list(p) + o.token_ids for p, o in zip(prompts, outs)]


@torch.inference_mode()
def hidden_states(model, sequences: list[list[int]], budget: int = 512) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per sequence (each at most `budget` tokens): (h [L,D] f32, y [L] i64), the target's final
    hidden state and greedy next token at every position, from steps that sample every row."""
    c = model.config
    out, i = [], 0
    while i < len(sequences):
        group = [sequences[i]]
        while i + len(group) < len(sequences) and sum(map(len, group)) + len(sequences[i + len(group)]) <= budget:
            group.append(sequences[i + len(group)])
        blocks = sum(-(-len(s) // 16) for s in group)
        cache = KVCache(c.num_layers, c.num_kv_heads, c.head_dim, DTYPES[model.dtype], CacheConfig(16, blocks))
        logits, _, hidden = model(build_step([SeqChunk(s, 0, [], samples=len(s)) for s in group], cache))
        a = 0
        for s in group:
            out.append((hidden[a:a + len(s)].float().clone(), logits[a:a + len(s)].argmax(-1)))
            a += len(s)
        i += len(group)
    return out


class Examples:
    """Flat arrays over sequences: h [P,D], x [P] (the sequence's tokens), y [P] (the target's
    next token); `starts` are positions t with t + depth inside their sequence."""

    def __init__(self, sequences, states, depth: int):
        self.h = torch.cat([h for h, _ in states])
        self.x = torch.cat([torch.tensor(s) for s in sequences])
        self.y = torch.cat([y for _, y in states])
        starts, a = [], 0
        for s in sequences:
            starts += range(a, a + len(s) - depth)
            a += len(s)
        self.starts = torch.tensor(starts, dtype=torch.long)

    def batch(self, idx: torch.Tensor, depth: int):
        """idx [N] into starts -> h [N,D], x [N,depth] (tokens t+1..t+depth), y [N,depth] (targets)."""
        t = self.starts[idx]
        js = t[:, None] + torch.arange(1, depth + 1)
        return self.h[t], self.x[js], self.y[js]


def head_loss(head, embed, lm_head, h, x, y):
    """Mean cross-entropy over the chained depths + the confidence head's BCE; also top-1 accuracy."""
    loss, correct = 0.0, 0.0
    for j in range(x.shape[1]):
        logits, h, conf = head(h, x[:, j], embed, lm_head)
        hit = (logits.argmax(-1) == y[:, j]).float()
        loss = loss + F.cross_entropy(logits, y[:, j]) + F.binary_cross_entropy_with_logits(conf, hit)
        correct += float(hit.mean())
    return loss / x.shape[1], correct / x.shape[1]


@torch.inference_mode()
def evaluate(head, embed, lm_head, sequences, states, prompt_lens, k: int) -> dict:
    """Drafting on generated text: at each position t whose next token was generated, k drafts
    chained from the head's own tokens; accepted = drafts before the first that differs from
    the target's greedy tokens. Also the first draft's mean confidence vs its accuracy."""
    rows = [(si, t) for si, s in enumerate(sequences) for t in range(prompt_lens[si] - 1, len(s) - 1 - k)]
    if not rows:
        return {}
    accepted, conf1, hit1 = [], [], []
    for a in range(0, len(rows), 512):
        part = rows[a:a + 512]
        h = torch.stack([states[si][0][t] for si, t in part])
        x = torch.tensor([sequences[si][t + 1] for si, t in part])
        want = torch.tensor([sequences[si][t + 2:t + 2 + k] for si, t in part])
        alive = torch.ones(len(part), dtype=torch.bool)
        n = torch.zeros(len(part))
        for j in range(k):
            logits, h, c = head(h, x, embed, lm_head)
            x = logits.argmax(-1)
            if j == 0:
                conf1.append(torch.sigmoid(c))
                hit1.append((x == want[:, 0]).float())
            alive &= x == want[:, j]
            n += alive.float()
        accepted.append(n)
    n = torch.cat(accepted)
    return {"positions": len(rows), "drafts": k, "acceptance_rate": float(n.mean() / k),
            "mean_accepted_length": float(n.mean() + 1), "first_draft_accuracy": float(torch.cat(hit1).mean()),
            "first_draft_mean_confidence": float(torch.cat(conf1).mean())}


def train_drafter(model, out_path: str, config: TrainConfig = TrainConfig(),
                  prompts: list[list[int]] | None = None, log=print) -> dict:
    """Generates data with `model` (a CompiledModel), trains a DraftHead, saves it to out_path
    and returns its metrics (also stored in the file)."""
    if model.tokenizer is None and prompts is None:
        raise DeepfuseError("this model has no tokenizer: pass prompts as token ids")
    torch.manual_seed(config.seed)
    t0 = time.perf_counter()
    prompts = prompts if prompts is not None else corpus_prompts(model.tokenizer, config.num_prompts, config.seed)
    prompts = [p[-(448 - config.max_tokens):] for p in prompts]  # prompt + continuation fit one 512-token pass
    log(f"generating {len(prompts)} greedy continuations of up to {config.max_tokens} tokens")
    seqs = continue_greedily(model, prompts, config.max_tokens)
    states = hidden_states(model, seqs)
    prompt_lens = [len(p) for p in prompts]
    t_data = time.perf_counter() - t0
    order = list(range(len(seqs)))
    random.Random(config.seed).shuffle(order)
    n_eval = max(1, len(seqs) // 10)
    train_ids, eval_ids = order[n_eval:] or order, order[:n_eval]
    train_set = Examples([seqs[i] for i in train_ids], [states[i] for i in train_ids], config.depth)
    held = ([seqs[i] for i in eval_ids], [states[i] for i in eval_ids], [prompt_lens[i] for i in eval_ids])
    if len(train_set.starts) == 0:
        raise DeepfuseError(f"sequences are too short for depth {config.depth}")

    embed, lm_head = target_weights(model)
    c = model.config
    head = DraftHead(c.hidden_size, config.intermediate_size or c.intermediate_size, c.vocab_size, c.rms_norm_eps)
    before = evaluate(head.eval(), embed, lm_head, *held, config.eval_drafts)
    opt = torch.optim.AdamW(head.parameters(), lr=config.lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(config.seed)
    log(f"training on {len(train_set.starts)} positions ({len(train_ids)} sequences), depth {config.depth}; "
        f"{len(eval_ids)} sequences held out")
    flush = torch.set_flush_denormal(True)  # softmax gradients underflow: denormal matmuls are ~15x slower
    head.train()
    steps, t_train, losses = 0, time.perf_counter(), []
    try:
        with tqdm(total=config.steps if config.steps < 100_000 else None, desc="training", unit="step",
                  leave=False) as bar:
            while steps < config.steps and time.perf_counter() - t_train < config.seconds:
                idx = torch.randint(len(train_set.starts), (config.batch_size,), generator=gen)
                lr = config.lr * min(1.0, (steps + 1) / 20)  # warm-up
                for group in opt.param_groups:
                    group["lr"] = lr
                loss, acc = head_loss(head, embed, lm_head, *train_set.batch(idx, config.depth))
                opt.zero_grad()
                loss.backward()
                opt.step()
                losses.append(float(loss))
                steps += 1
                bar.update()
                bar.set_postfix(loss=f"{loss.item():.3f}", top1=f"{acc:.2f}")
    finally:
        if flush:
            torch.set_flush_denormal(False)
    head.eval()
    after = evaluate(head, embed, lm_head, *held, config.eval_drafts)
    metrics = {"config": asdict(config), "sequences": len(seqs), "train_positions": len(train_set.starts),
               "steps": steps, "data_seconds": round(t_data, 1),
               "train_seconds": round(time.perf_counter() - t_train, 1),
               "first_loss": losses[0], "last_loss": sum(losses[-10:]) / len(losses[-10:]),
               "heldout_untrained": before, "heldout": after}
    if not all(map(math.isfinite, losses)):
        raise DeepfuseError("training diverged (non-finite loss); lower the learning rate")
    head.save(out_path, target_probe(lm_head), metrics)
    return metrics
