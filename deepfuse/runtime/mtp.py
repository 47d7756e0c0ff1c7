"""MTP draft head: drafts from the target's own last hidden state, as DeepSeek-V3's multi-token
prediction module does, with a confidence head that says how likely each draft is accepted.

One step of the head, for a sequence whose target step ended at position t:

    h [N,D]    the target's final-normed hidden state at t (the step's `hidden` output)
    x [N]      the token at t + 1 (the target's own sample)
    ctx [N,W]  the sequence's last W tokens, ending with x (-1: before the sequence's start)
    z  = proj([norm_h(h); norm_e(embed(x))])             [N,D]
    p  = copy attention over ctx                          (query from z; key j = token j, plus a
                                                           learned bonus where token j == x;
                                                           value j = the token after it)
    z  = z + o(p @ v)
    z  = z + down(silu(gate(norm_m(z))) * up(norm_m(z)))
    out = norm_o(z)                                       [N,D]
    logits = out @ lm_head^T + g * (p scattered onto the tokens after each key)   [N,V]
                                                          -> the draft for t + 2
    confidence = sigmoid(conf([out; log p_max; entropy]))  [N]  P(the target agrees)

The copy attention is what an MLP on h alone lacks: text that repeats earlier text (quoting,
editing code) is predicted by finding where x occurred before and reading what followed, as
an induction head does, and a pointer term adds those tokens' attention to the logits; a
zero-valued null slot lets it attend to nothing. Drafting k tokens applies the head k times,
feeding `out`, the draft, and the context extended by the draft back in. The embedding and
the LM head are the target's (frozen, not stored): the head file holds only its own weights
(~3.6M for SmolLM2) and probe rows of the target's LM head that identify the model it was
trained for. `deepfuse train-drafter` trains one (train_drafter.py).
"""
from __future__ import annotations

import json

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import DeepfuseError
from .spec import Draft, Drafter, DraftGate

FORMAT, VERSION = "deepfuse-mtp-head", "3"  # 2: copy attention over the context; 3: and a pointer term
CONTEXT = 64  # tokens of context the copy attention sees (W)
COPY_HEADS, COPY_DIM = 2, 64
PROBE_ROWS = 16  # LM-head rows stored to recognise the target
PROBE_TOLERANCE = 0.05  # relative difference allowed (bf16/f16 rounding of the same weights)


class DraftHead(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, vocab_size: int, eps: float = 1e-5):
        super().__init__()
        self.hidden_size, self.intermediate_size, self.vocab_size, self.eps = (
            hidden_size, intermediate_size, vocab_size, eps)
        self.norm_h = nn.RMSNorm(hidden_size, eps=eps)
        self.norm_e = nn.RMSNorm(hidden_size, eps=eps)
        self.proj = nn.Linear(2 * hidden_size, hidden_size, bias=False)
        self.norm_m = nn.RMSNorm(hidden_size, eps=eps)
        self.gate_up = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.norm_o = nn.RMSNorm(hidden_size, eps=eps)
        self.conf = nn.Linear(hidden_size + 2, 1)
        inner = COPY_HEADS * COPY_DIM
        self.norm_c = nn.RMSNorm(hidden_size, eps=eps)
        self.copy_q = nn.Linear(hidden_size, inner, bias=False)
        self.copy_k = nn.Linear(hidden_size, inner, bias=False)
        self.copy_v = nn.Linear(hidden_size, inner, bias=False)
        self.copy_o = nn.Linear(inner, hidden_size, bias=False)
        # scalars start where copying already works (Adam moves them ~lr per step, so init matters)
        self.recency = nn.Parameter(torch.zeros(COPY_HEADS))  # per head: score lost across the window
        self.match = nn.Parameter(torch.full((COPY_HEADS,), 8.0))  # per head: score for key token == x
        self.pointer = nn.Parameter(torch.tensor(12.0))  # softplus of it: logits per unit of copy attention
        nn.init.zeros_(self.down.weight)  # the MLP and the copy attention start as the identity
        nn.init.zeros_(self.copy_o.weight)

    def copy(self, z: torch.Tensor, ctx: torch.Tensor, embed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """z [N,D], ctx [N,W] -> ([N,D], [N,W-1]): attention from z over keys ctx[:, j] with
        values ctx[:, j + 1] (the token that followed), plus a null slot of score 0 and value 0;
        its output and its weights (mean over heads) on each following token."""
        n, w = ctx.shape
        e = self.norm_c(F.embedding(ctx.clamp(min=0), embed))  # [N,W,D]
        k = self.copy_k(e[:, :-1]).view(n, w - 1, COPY_HEADS, COPY_DIM).transpose(1, 2)
        v = self.copy_v(e[:, 1:]).view(n, w - 1, COPY_HEADS, COPY_DIM).transpose(1, 2)
        q = self.copy_q(z).view(n, COPY_HEADS, 1, COPY_DIM)
        dist = torch.arange(w - 2, -1, -1, dtype=z.dtype, device=z.device) / w  # key j: (w-2-j)/w of the window back
        scores = (q @ k.transpose(-1, -2)).squeeze(2) * COPY_DIM ** -0.5  # [N,heads,W-1]
        scores = scores - F.softplus(self.recency)[None, :, None] * dist
        scores = scores + self.match[None, :, None] * (ctx[:, :-1] == ctx[:, -1:])[:, None, :]
        scores = scores.masked_fill((ctx[:, :-1] < 0)[:, None, :], float("-inf"))
        probs = torch.cat([scores, scores.new_zeros(n, COPY_HEADS, 1)], -1).softmax(-1)[..., :-1]
        return self.copy_o((probs.unsqueeze(2) @ v).reshape(n, -1)), probs.mean(1)

    def forward(self, h: torch.Tensor, x: torch.Tensor, ctx: torch.Tensor, embed: torch.Tensor,
                lm_head: torch.Tensor):
        """h [N,D] f32, x [N] i64, ctx [N,CONTEXT] i64 (ending with x), embed [V,D], lm_head [V,D]
        -> (logits [N,V], out [N,D], confidence logit [N]; its sigmoid: the chance the target agrees)."""
        z = self.proj(torch.cat([self.norm_h(h), self.norm_e(F.embedding(x, embed))], -1))
        copied, weights = self.copy(z, ctx, embed)
        z = z + copied
        gate, up = self.gate_up(self.norm_m(z)).chunk(2, -1)
        out = self.norm_o(z + self.down(F.silu(gate) * up))
        pointer = torch.zeros(len(x), lm_head.shape[0], dtype=weights.dtype, device=weights.device).scatter_add_(
            1, ctx[:, 1:].clamp(min=0), weights)  # padding keys have weight 0
        logits = F.linear(out, lm_head) + F.softplus(self.pointer) * pointer
        logp = torch.log_softmax(logits.detach(), -1)
        entropy = -(logp.exp() * logp).sum(-1, keepdim=True)
        features = torch.cat([out.detach(), logp.max(-1, keepdim=True).values, entropy], -1)
        return logits, out, self.conf(features).squeeze(-1)

    def save(self, path: str, probe: torch.Tensor, metrics: dict | None = None) -> None:
        """probe: rows of the target's LM head (see target_probe)."""
        from safetensors.torch import save_file

        tensors = {k: v.detach().contiguous() for k, v in self.state_dict().items()}
        tensors["target_probe"] = probe.float().contiguous()
        meta = {"format": FORMAT, "version": VERSION, "hidden_size": str(self.hidden_size),
                "intermediate_size": str(self.intermediate_size), "vocab_size": str(self.vocab_size),
                "eps": repr(self.eps), "metrics": json.dumps(metrics or {})}
        save_file(tensors, path, metadata=meta)

    @staticmethod
    def load(path: str) -> tuple[DraftHead, torch.Tensor, dict]:
        """-> (head, target probe rows, training metrics). Raises DeepfuseError if `path` is not a head file."""
        from safetensors import safe_open

        try:
            with safe_open(path, "pt") as f:
                meta = f.metadata() or {}
                tensors = {k: f.get_tensor(k) for k in f.keys()}
        except (OSError, ValueError, RuntimeError) as e:
            raise DeepfuseError(f"cannot read draft head {path}: {e}") from None
        if meta.get("format") != FORMAT:
            raise DeepfuseError(f"{path} is not a deepfuse MTP draft head (train one with `deepfuse train-drafter`)")
        if meta.get("version") != VERSION:
            raise DeepfuseError(f"draft head {path} has format version {meta.get('version')}, this deepfuse reads "
                                f"{VERSION}; train it again")
        head = DraftHead(int(meta["hidden_size"]), int(meta["intermediate_size"]), int(meta["vocab_size"]),
                         float(meta["eps"]))
        probe = tensors.pop("target_probe")
        head.load_state_dict(tensors)
        return head.eval(), probe, json.loads(meta.get("metrics", "{}"))


def context(tokens: list[int]) -> list[int]:
    """The last CONTEXT tokens, left-padded with -1."""
    tail = tokens[-CONTEXT:]
    return [-1] * (CONTEXT - len(tail)) + tail


def extend(ctx: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """ctx [N,W] with token x [N] appended and the oldest dropped."""
    return torch.cat([ctx[:, 1:], x[:, None]], 1)


def target_weights(model) -> tuple[torch.Tensor, torch.Tensor]:
    """The compiled target's embedding table and LM head [V,D], as f32 (the same tensor if tied)."""
    g = model.graph
    embed = next((n.inputs[0] for n in g.nodes if n.op == "embedding"), None)
    head = next((n.inputs[1] for n in g.nodes if n.op == "logits"), None)
    if embed is None or head is None or embed.name not in g.weights or head.name not in g.weights:
        raise DeepfuseError("this model's step has no embedding table and LM head an MTP draft head can share")
    e = g.weights[embed.name].float()
    return e, (e if head.name == embed.name else g.weights[head.name].float())


def target_probe(lm_head: torch.Tensor) -> torch.Tensor:
    """PROBE_ROWS rows spread over the vocabulary [PROBE_ROWS, D]."""
    return lm_head[torch.linspace(0, lm_head.shape[0] - 1, PROBE_ROWS).long()].float()


def check_head_fits(head: DraftHead, probe: torch.Tensor, lm_head: torch.Tensor, path: str) -> None:
    if head.vocab_size != lm_head.shape[0]:
        raise DeepfuseError(f"draft head {path} has a vocabulary of {head.vocab_size} tokens, the target "
                            f"{lm_head.shape[0]}: its drafts cannot be verified")
    if head.hidden_size != lm_head.shape[1]:
        raise DeepfuseError(f"draft head {path} reads hidden states of {head.hidden_size}, the target's are "
                            f"{lm_head.shape[1]}")
    mine = target_probe(lm_head)
    diff = float((mine - probe).norm() / probe.norm().clamp_min(1e-12))
    if diff > PROBE_TOLERANCE:
        raise DeepfuseError(f"draft head {path} was trained for another model (its LM-head probe differs "
                            f"by {diff:.0%} from this model's)")


class MtpDrafter(Drafter):
    """Drafts with a DraftHead from each request's last hidden state (Request.hidden, kept by
    the engine from every step's `hidden` output). A draft's confidence is the running
    product of the head's per-token confidences. Each draft reads the whole LM head, so on a
    weight-bound machine one costs (LM head + head weights) / target weights of a target step:
    requests whose drafts do not pay that are skipped (spec.DraftGate)."""

    needs_hidden = True

    def __init__(self, path: str, model):
        self.head, probe, self.metrics = DraftHead.load(path)
        self.embed, self.lm_head = target_weights(model)
        check_head_fits(self.head, probe, self.lm_head, path)
        own = sum(p.numel() for p in self.head.parameters()) + self.lm_head.numel()
        self.gate = DraftGate(own / sum(w.numel() for w in model.graph.weights.values()))

    @torch.inference_mode()
    def propose_batch(self, requests: list, ks: list[int]) -> list[Draft]:
        drafts = [Draft([], []) for _ in requests]
        live = [i for i, (r, k) in enumerate(zip(requests, ks))
                if k > 0 and r.hidden is not None and self.gate.worth_drafting(r, k)]
        if not live:
            return drafts
        h = torch.stack([requests[i].hidden for i in live])
        x = torch.tensor([requests[i].tokens[-1] for i in live])
        ctx = torch.tensor([context(requests[i].tokens) for i in live])
        conf = torch.ones(len(live))
        for j in range(max(ks[i] for i in live)):
            logits, h, c = self.head(h, x, ctx, self.embed, self.lm_head)
            x = logits.argmax(-1)
            ctx = extend(ctx, x)
            conf = conf * torch.sigmoid(c)
            for row, i in enumerate(live):
                if ks[i] > j:
                    drafts[i].tokens.append(int(x[row]))
                    drafts[i].confidence.append(float(conf[row]))
        return drafts
