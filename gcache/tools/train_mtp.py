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

from gcache.worker.config import ModelConfig
from gcache.worker.model.weights import init_weights, save_npz

TINY_MTP: dict[str, Any] = dict(
    vocab_size=260,  # 256 bytes + bos/eos/pad + 1 spare
    hidden=96,
    layers=4,
    layer_pattern=("swa", "swa", "full", "swa"),
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


def build(torch, cfg: ModelConfig):
    """Parameters (from the worker's own seeded init) and the forward: main + MTP logits."""
    F = torch.nn.functional
    params = {k: torch.nn.Parameter(torch.tensor(v, dtype=torch.float32)) for k, v in init_weights(cfg).items()}
    half = cfg.head_dim // 2
    inv = 1.0 / (cfg.rope_theta ** (np.arange(half, dtype=np.float64) / half))

    def rms(x, name):
        return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + cfg.rms_eps) * params[name]

    def rope(x, cos, sin):  # x [B, T, H, D]
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)

    def block(p, x, cos, sin, mask):
        b, t, _ = x.shape
        h = rms(x, p + "attn_norm.weight")
        q = rope((h @ params[p + "attn.wq"]).view(b, t, cfg.heads, cfg.head_dim), cos, sin)
        k = rope((h @ params[p + "attn.wk"]).view(b, t, cfg.kv_heads, cfg.head_dim), cos, sin)
        v = (h @ params[p + "attn.wv"]).view(b, t, cfg.kv_heads, cfg.head_dim)
        g = cfg.heads // cfg.kv_heads  # query head j uses kv head j // g (numpy: reshape(kvh, g))
        k, v = k.repeat_interleave(g, dim=2), v.repeat_interleave(g, dim=2)
        att = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask)
        x = x + att.transpose(1, 2).reshape(b, t, -1) @ params[p + "attn.wo"]
        h = rms(x, p + "mlp_norm.weight")
        return x + (F.silu(h @ params[p + "mlp.w_gate"]) * (h @ params[p + "mlp.w_up"])) @ params[p + "mlp.w_down"]

    def forward(tokens):
        """tokens [B, T] -> [main logits [B, T, V], MTP depth d logits [B, T - d, V]...]."""
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
            x = block(f"layers.{i}.", x, cos, sin, causal if kind == "full" else window)
        outs = [rms(x, "final_norm.weight") @ params["lm_head.weight"]]
        h = x
        for d in range(cfg.mtp_layers):
            p, n = f"mtp.{d}.", t - (d + 1)
            u = torch.cat([rms(emb[tokens[:, d + 1 :]], p + "enorm.weight"), rms(h[:, :n], p + "hnorm.weight")], -1)
            h = block(p, u @ params[p + "proj"], cos[:, :n], sin[:, :n], window[:n, :n])
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
    ap.add_argument("--init", help="start from these weights (an .npz of the same geometry) instead of the seeded init")
    ap.add_argument(
        "--mtp-only", action="store_true", help="train the MTP blocks only (the main model frozen, e.g. with --init)"
    )
    args = ap.parse_args(argv)
    import torch

    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    F = torch.nn.functional
    cfg = ModelConfig(**TINY_MTP)
    train, held = corpus(int(args.corpus_mib * (1 << 20)))
    print(f"corpus: {train.size} train bytes, {held.size} held-out bytes (stdlib of Python {sys.version.split()[0]})")
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
        starts = rng.integers(0, train.size - args.seq - 1, args.batch)
        batch = torch.tensor(np.stack([train[s : s + args.seq] for s in starts]))
        ls = losses(F, forward(batch), batch)
        loss = ls[0] + args.mtp_weight * sum(ls[1:])
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trained.values(), 1.0)
        opt.step()
        if step % 25 == 0 or step == args.steps - 1:
            print(
                f"step {step:4d} lr {lr:.2e} loss main {ls[0].item():.3f} mtp "
                + " ".join(f"{x.item():.3f}" for x in ls[1:])
                + f"  {time.monotonic() - t0:.0f}s",
                flush=True,
            )
    weights = {k: v.detach().numpy().astype(np.float32) for k, v in params.items()}
    save_npz(args.out, cfg, weights)
    check(torch, forward, F, cfg, weights, held, args.seq)
    print(f"wrote {args.out} ({Path(args.out).stat().st_size / 1e6:.1f} MB) in {time.monotonic() - t0:.0f}s")


def check(torch, forward, F, cfg, weights, held, seq) -> None:
    """Held-out loss and top-1 agreement of each MTP depth with the text, and the numpy
    model's logits against torch's (the worker runs what was trained)."""
    from gcache.worker.model.transformer import Model

    rng = np.random.default_rng(0)
    starts = rng.integers(0, held.size - seq - 1, 8)
    batch = torch.tensor(np.stack([held[s : s + seq] for s in starts]))
    with torch.no_grad():
        outs = forward(batch)
        ls = losses(F, outs, batch)
        acc = [(o[:, : seq - d - 1].argmax(-1) == batch[:, d + 1 :]).float().mean().item() for d, o in enumerate(outs)]
    print("held-out loss " + " ".join(f"{x.item():.3f}" for x in ls) + "; top-1 " + " ".join(f"{a:.2f}" for a in acc))
    ref = Model(cfg.with_dtype("float64"), {k: v.astype(np.float64) for k, v in weights.items()}).reference_logits(
        batch[0].numpy()
    )
    diff = float(np.abs(np.asarray(ref) - outs[0][0].numpy()).max())
    print(f"numpy vs torch main logits: max |diff| {diff:.2e}")
    if diff > 1e-2:
        raise SystemExit("the numpy model disagrees with the trained one")


if __name__ == "__main__":
    main()
