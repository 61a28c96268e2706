"""Train the tiny hybrid model the worker ships, with its MTP blocks, on the Python standard
library's own source (bytes; every machine with Python has the corpus). Training-time only:
torch on CPU, seeded; the worker reads the result with numpy (gcache.worker.model.weights).

The torch graph below is the numpy model's math exactly (transformer.Model, model/mtp.py):
RMSNorm, rotate-half RoPE, GQA, sliding-window / full causal attention, SwiGLU, y = x @ W;
MTP block d at position i: [RMSNorm(embed(x[i+d])) ; RMSNorm(h[d-1][i])] @ proj, a block
with window attention, the shared head; it learns x[i+d+1]. The script ends by checking the
numpy model's logits against torch's on held-out text.

  PYTHONPATH=. ~/.cache/gcache/venv-sglang-*/bin/python -m gcache.tools.train_mtp \\
      --out gcache/worker/model/presets/tiny_mtp_stdlib.npz     # ~5 min on 2 cores

The second preset, tiny_mtp_recur.npz (--geometry tiny-mtp-w128: W = 128), has MTP drafts
that read their window. Its corpus is the same source with recurring spans (--recur 0.8: at
a line end, with probability 0.8, the next 16..240 bytes repeat those --lag 120 before them,
--edits 0.03 of them another byte): text whose continuation only the window tells. Two
phases, so that the MTP blocks must read their window for it (a main model trained beside
them would learn to carry the next-but-one byte in its hidden state): the main model alone
(--mtp-weight 0), then the MTP blocks alone on it, frozen (--init, --mtp-only). The check at
the end prints, with --recur, top-1 on held-out text's recurring bytes with the MTP blocks'
attention output zeroed beside it. --threads 1 on a shared box (2 threads there: 10x slower).
Copying at a fixed distance is learnt in a few hundred steps; copying at any distance (an
induction head) had not formed after 800 steps of lines recurring at any distance, nor after
900 of a pure copying task, so the spans recur at one lag.

  P=$(ls -d ~/.cache/gcache/venv-sglang-*/bin/python)     # ~3 + ~3.5 min on 2 shared cores
  PYTHONPATH=. $P -m gcache.tools.train_mtp --geometry tiny-mtp-w128 --recur 0.8 --edits 0.03 \\
      --lag 120 --seq 256 --steps 800 --mtp-weight 0 --threads 1 --out /tmp/recur_main.npz
  PYTHONPATH=. $P -m gcache.tools.train_mtp --geometry tiny-mtp-w128 --recur 0.8 --edits 0.03 \\
      --lag 120 --seq 256 --steps 800 --init /tmp/recur_main.npz --mtp-only --threads 1 \\
      --out gcache/worker/model/presets/tiny_mtp_recur.npz
"""

from __future__ import annotations

import argparse
import math
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

import numpy as np

from gcache.common.attention import AttentionKind
from gcache.worker.config import ModelConfig
from gcache.worker.model.weights import init_weights, save_npz

TINY_MTP: dict[str, Any] = dict(
    vocab_size=260,  # 256 bytes + bos/eos/pad + 1 spare
    hidden=96,
    layers=4,
    layer_pattern=(AttentionKind.SWA, AttentionKind.SWA, AttentionKind.FULL, AttentionKind.SWA),
    heads=4,
    kv_heads=2,
    head_dim=24,
    intermediate=192,
    window=64,
    page_size=16,
    mtp_layers=3,
    dtype="float32",
    seed=19,
)
# the preset whose MTP blocks read their window (tiny_mtp_recur.npz): W = 128, as the production
# models' SWA (the first 128 tokens after a hit all read the prefix's MTP window)
GEOMETRIES = {"tiny-mtp": TINY_MTP, "tiny-mtp-w128": dict(TINY_MTP, window=128, seed=23)}


def corpus(limit_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    """(train, held-out) bytes of the stdlib's .py files in sorted path order (every 20th
    file held out): the same on every machine with the same Python."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and "test" not in p.parts)
    train, held = bytearray(), bytearray()
    for i, p in enumerate(files):
        if len(train) >= limit_bytes:
            break
        try:
            data = p.read_bytes()
        except OSError:
            continue
        (held if i % 20 == 19 else train).extend(data + b"\n")
    return np.frombuffer(bytes(train), np.uint8).astype(np.int64), np.frombuffer(bytes(held), np.uint8).astype(np.int64)


def recur(
    data: np.ndarray, rng: np.random.Generator, q: float, lag: int, n: int, edits: float = 0.0
) -> tuple[np.ndarray, np.ndarray]:
    """(text, copied): the first n bytes of `data` (corpus bytes, more than n) with recurring
    spans: at each line end at least `lag` bytes in, with probability q, the next L bytes
    (L uniform in [16, 2 * lag]) repeat the bytes `lag` before them (the text is periodic
    for L bytes), each one with probability `edits` another byte of `data` instead (an
    edited copy goes on after a byte that differs), then the source goes on.
    copied[i]: byte i is such a copy (the bytes only the window tells). q = 0: data[:n]."""
    if q <= 0:
        return data[:n], np.zeros(n, bool)
    out, cop = np.empty(2 * n, np.int64), np.zeros(2 * n, bool)
    size = 0
    cuts = np.flatnonzero(data == 10) + 1  # line ends ("\n" included)
    for a, b in zip(np.concatenate([[0], cuts]), np.concatenate([cuts, [data.size]])):
        if size >= n:
            break
        m = min(b - a, 2 * n - size)
        out[size : size + m] = data[a : a + m]
        size += m
        if size >= lag and size < n and rng.random() < q:
            span = min(int(rng.integers(16, 2 * lag + 1)), 2 * n - size)
            edited = rng.random(span) < edits if edits > 0 else np.zeros(span, bool)
            for j, i in enumerate(range(size, size + span)):  # a span longer than lag repeats itself
                out[i] = data[int(rng.integers(data.size))] if edited[j] else out[i - lag]
            cop[size : size + span] = ~edited
            size += span
    return out[:n], cop[:n]


def sample(
    train: np.ndarray, rng: np.random.Generator, batch: int, seq: int, q: float, lag: int, edits: float = 0.0
) -> np.ndarray:
    """A training batch [batch, seq]: random windows of the corpus, spans recurring (q > 0)."""
    if q <= 0:  # the draws of the original script (tiny_mtp_stdlib.npz)
        starts = rng.integers(0, train.size - seq - 1, batch)
        return np.stack([train[s : s + seq] for s in starts])
    starts = rng.integers(0, train.size - 2 * seq - 1, batch)
    return np.stack([recur(train[s : s + 2 * seq], rng, q, lag, seq, edits)[0] for s in starts])


def build(torch, cfg: ModelConfig, init: dict[str, np.ndarray] | None = None):
    """Parameters (from the worker's own seeded init, or `init`) and the forward: main + MTP logits."""
    F = torch.nn.functional
    start = init_weights(cfg) if init is None else init
    params = {k: torch.nn.Parameter(torch.tensor(v, dtype=torch.float32)) for k, v in start.items()}
    half = cfg.head_dim // 2
    inv = 1.0 / (cfg.rope_theta ** (np.arange(half, dtype=np.float64) / half))

    def rms(x, name):
        return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + cfg.rms_eps) * params[name]

    def rope(x, cos, sin):  # x [B, T, H, D]
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)

    def block(p, x, cos, sin, mask, attn_scale=1.0):
        b, t, _ = x.shape
        h = rms(x, p + "attn_norm.weight")
        q = rope((h @ params[p + "attn.wq"]).view(b, t, cfg.heads, cfg.head_dim), cos, sin)
        k = rope((h @ params[p + "attn.wk"]).view(b, t, cfg.kv_heads, cfg.head_dim), cos, sin)
        v = (h @ params[p + "attn.wv"]).view(b, t, cfg.kv_heads, cfg.head_dim)
        g = cfg.heads // cfg.kv_heads  # query head j uses kv head j // g (numpy: reshape(kvh, g))
        k, v = k.repeat_interleave(g, dim=2), v.repeat_interleave(g, dim=2)
        att = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask)
        x = x + attn_scale * (att.transpose(1, 2).reshape(b, t, -1) @ params[p + "attn.wo"])
        h = rms(x, p + "mlp_norm.weight")
        return x + (F.silu(h @ params[p + "mlp.w_gate"]) * (h @ params[p + "mlp.w_up"])) @ params[p + "mlp.w_down"]

    def forward(tokens, ablate_mtp_window=False, mtp=True):
        """tokens [B, T] -> [main logits [B, T, V], MTP depth d logits [B, T - d, V]...].
        ablate_mtp_window: the MTP blocks' attention output times 0 (they read no window);
        mtp=False: the main logits only."""
        b, t = tokens.shape
        pos = np.arange(t)
        ang = pos[:, None] * inv[None, :]
        cos = torch.tensor(np.cos(ang), dtype=torch.float32)[None, :, None, :]
        sin = torch.tensor(np.sin(ang), dtype=torch.float32)[None, :, None, :]
        causal = torch.tensor(pos[None, :] <= pos[:, None])
        window = causal & torch.tensor(pos[None, :] > pos[:, None] - cfg.window)
        emb = params["embed.weight"]
        x = emb[tokens]
        for i, kind in enumerate(cfg.layer_pattern):
            x = block(f"layers.{i}.", x, cos, sin, causal if kind == AttentionKind.FULL else window)
        outs = [rms(x, "final_norm.weight") @ params["lm_head.weight"]]
        h = x
        for d in range(cfg.mtp_layers if mtp else 0):
            p, n = f"mtp.{d}.", t - (d + 1)
            u = torch.cat([rms(emb[tokens[:, d + 1 :]], p + "enorm.weight"), rms(h[:, :n], p + "hnorm.weight")], -1)
            scale = 0.0 if ablate_mtp_window else 1.0
            h = block(p, u @ params[p + "proj"], cos[:, :n], sin[:, :n], window[:n, :n], scale)
            outs.append(rms(h, p + "final_norm.weight") @ params["lm_head.weight"])
        return outs

    return params, forward


def losses(F, outs, tokens):
    """Cross-entropy per head: main predicts x[i+1], depth d predicts x[i+d+1]."""
    out = []
    for d, lg in enumerate(outs):
        n = tokens.shape[1] - d - 1
        out.append(F.cross_entropy(lg[:, :n].reshape(-1, lg.shape[-1]), tokens[:, d + 1 : d + 1 + n].reshape(-1)))
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--mtp-weight", type=float, default=0.5, help="loss weight of each MTP depth")
    ap.add_argument("--corpus-mib", type=float, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=19)
    ap.add_argument(
        "--geometry", choices=sorted(GEOMETRIES), default="tiny-mtp", help="tiny-mtp (W 64) or tiny-mtp-w128 (W 128)"
    )
    ap.add_argument(
        "--recur",
        type=float,
        default=0.0,
        help="probability that a line end starts a span repeating the bytes --lag before it; 0 = the source as it is",
    )
    ap.add_argument(
        "--lag", type=int, default=120, help="with --recur: how far back a recurring span's source is (< W)"
    )
    ap.add_argument(
        "--edits", type=float, default=0.0, help="with --recur: probability that a byte of a recurring span is another"
    )
    ap.add_argument("--init", help="start from these weights (an .npz of the same geometry) instead of the seeded init")
    ap.add_argument(
        "--mtp-only", action="store_true", help="train the MTP blocks only (the main model frozen, e.g. with --init)"
    )
    args = ap.parse_args(argv)
    import torch

    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    F = torch.nn.functional
    cfg = ModelConfig(**GEOMETRIES[args.geometry])
    train, held = corpus(int(args.corpus_mib * (1 << 20)))
    print(f"corpus: {train.size} train bytes, {held.size} held-out bytes (stdlib of Python {sys.version.split()[0]})")
    if args.recur > 0:
        if not 16 <= args.lag < cfg.window:
            raise SystemExit(
                f"--lag {args.lag}: a recurring span's source must be in the window (16 <= lag < {cfg.window})"
            )
        print(
            f"spans recur: at a line end, with probability {args.recur}, 16..{2 * args.lag} bytes repeat those {args.lag} back"
        )
    params, forward = build(torch, cfg)
    if args.init:
        from gcache.worker.model.weights import load

        init_cfg, init_w = load(args.init)
        if init_cfg != cfg:
            raise SystemExit(f"--init {args.init}: another geometry than the one this script trains")
        with torch.no_grad():
            for k, v in init_w.items():
                params[k].copy_(torch.tensor(v, dtype=torch.float32))
    trained = {k: p for k, p in params.items() if not args.mtp_only or k.startswith("mtp.")}
    for k, p in params.items():
        p.requires_grad_(k in trained)
    opt = torch.optim.AdamW(trained.values(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    rng = np.random.default_rng(args.seed)
    t0 = time.monotonic()
    for step in range(args.steps):
        lr = args.lr * min(1.0, (step + 1) / 30) * 0.5 * (1 + math.cos(math.pi * step / args.steps))
        for g in opt.param_groups:
            g["lr"] = lr
        batch = torch.tensor(sample(train, rng, args.batch, args.seq, args.recur, args.lag, args.edits))
        ls = losses(F, forward(batch, mtp=args.mtp_weight > 0), batch)  # weight 0: main model alone
        loss = ls[0] + args.mtp_weight * sum(ls[1:])
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trained.values(), 1.0)
        opt.step()
        if step % 25 == 0 or step == args.steps - 1:
            print(
                f"step {step:4d} lr {lr:.2e} loss main {ls[0].item():.3f}"
                + (" mtp " if len(ls) > 1 else "")
                + " ".join(f"{x.item():.3f}" for x in ls[1:])
                + f"  {time.monotonic() - t0:.0f}s",
                flush=True,
            )
    weights = {k: v.detach().numpy().astype(np.float32) for k, v in params.items()}
    save_npz(args.out, cfg, weights)
    check(torch, forward, F, cfg, weights, held, args.seq, args.recur, args.lag, args.edits)
    print(f"wrote {args.out} ({Path(args.out).stat().st_size / 1e6:.1f} MB) in {time.monotonic() - t0:.0f}s")


def check(torch, forward, F, cfg, weights, held, seq, q: float = 0.0, lag: int = 0, edits: float = 0.0) -> None:
    """Held-out loss and top-1 agreement of each MTP depth with the text, and the numpy
    model's logits against torch's (the worker runs what was trained). q > 0: also top-1 on
    the recurring bytes of held-out text with recurring spans, the MTP blocks' attention
    output zeroed beside it (what their window adds)."""
    from gcache.worker.model.transformer import Model

    rng = np.random.default_rng(0)
    starts = rng.integers(0, held.size - seq - 1, 8)
    batch = torch.tensor(np.stack([held[s : s + seq] for s in starts]))
    with torch.no_grad():
        outs = forward(batch)
        ls = losses(F, outs, batch)
        acc = [(o[:, : seq - d - 1].argmax(-1) == batch[:, d + 1 :]).float().mean().item() for d, o in enumerate(outs)]
    print("held-out loss " + " ".join(f"{x.item():.3f}" for x in ls) + "; top-1 " + " ".join(f"{a:.2f}" for a in acc))
    if q > 0:
        rng = np.random.default_rng(1)
        starts = rng.integers(0, held.size - 2 * seq - 1, 16)
        rows = [recur(held[s : s + 2 * seq], rng, q, lag, seq, edits) for s in starts]
        rb = torch.tensor(np.stack([r[0] for r in rows]))
        cop = torch.tensor(np.stack([r[1] for r in rows]))
        for label, ablate in (("with", False), ("without", True)):
            with torch.no_grad():
                ro = forward(rb, ablate_mtp_window=ablate)
            acc = []
            for d, o in enumerate(ro):
                hit = o[:, : seq - d - 1].argmax(-1) == rb[:, d + 1 :]
                m = cop[:, d + 1 :]
                acc.append((hit[m].float().mean().item(), hit[~m].float().mean().item()))
            print(
                f"held-out, spans recurring ({q}), MTP {label} its window: top-1 on recurring / other bytes "
                + " ".join(f"{a:.2f}/{b:.2f}" for a, b in acc)
            )
    ref = Model(cfg.with_dtype("float64"), {k: v.astype(np.float64) for k, v in weights.items()}).reference_logits(
        batch[0].numpy()
    )
    diff = float(np.abs(np.asarray(ref) - outs[0][0].numpy()).max())
    print(f"numpy vs torch main logits: max |diff| {diff:.2e}")
    if diff > 1e-2:
        raise SystemExit("the numpy model disagrees with the trained one")


if __name__ == "__main__":
    main()
