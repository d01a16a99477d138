#!/usr/bin/env python3
"""PyTorch FSDP2 peer of `train_gpt`: the same GPT shapes, timed the same way.

GPU (`--device cuda`, the default): one process on one GPU (`world_size` 1, NCCL).
CPU (`--device cpu`): `--world N` processes (gloo, rank r on its own process, each with
`--threads` intra-op threads, default max(1, cores / N)), like `train_gpt --ranks N` on CPU
thread ranks. Either way `fully_shard` on every transformer block and on the root, SGD or
AdamW (`--optimizer`, lr 1e-3), each rank its own `--batch` sequences, and one JSON line per
configuration (printed by rank 0) with `step_ms_median` (rank 0's median over the timed steps,
the first `--warmup` steps excluded, each step ended by `loss.item()` and, on a GPU,
`torch.cuda.synchronize()`), `tokens_per_s` (all ranks' tokens) and `peak_allocated_bytes`
(`torch.cuda.max_memory_allocated`; null on CPU).

The model is GPT-2's architecture as `fsdp-autograd/src/nn/gpt.rs` builds it: token and
position embeddings, pre-LayerNorm blocks (causal self-attention through
`scaled_dot_product_attention`, a 4x GELU MLP, biases everywhere), a final LayerNorm and an LM
head without bias (tied to the token embedding for gpt2). Weights are random: only time and
memory are compared, never losses.

    python3 fsdp-train/benches/torch_fsdp2_peer.py --config mini --config gpt2 --config gpt2:bf16
    python3 fsdp-train/benches/torch_fsdp2_peer.py --device cpu --world 4 --optimizer adamw

`cargo xtask gpu-peer` runs it beside train_gpt and prints the ratios (":tf32" lets f32
matrix products use TF32, like train_gpt --tf32); `cargo xtask bench cpu-peer` runs the CPU
form beside `train_gpt --ranks 4 --optimizer adamw`, interleaved.
"""
import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

PRESETS = {
    # name: (vocab, d_model, layers, heads, seq, tied, default batch)
    "mini": (256, 256, 4, 4, 128, False, 4),
    "small": (256, 512, 8, 8, 256, False, 16),
    "gpt2": (50257, 768, 12, 12, 1024, True, 4),
}


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class Gpt(nn.Module):
    def __init__(self, vocab, d, layers, heads, seq, tied):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        if tied:
            self.head.weight = self.tok.weight

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))


def run(name, mp, offload, batch, steps, warmup, dev, optimizer="sgd"):
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    vocab, d, layers, heads, seq, tied, default_batch = PRESETS[name]
    batch = batch or default_batch
    torch.manual_seed(0)
    model = Gpt(vocab, d, layers, heads, seq, tied).to(dev)
    cuda = dev == "cuda"
    kw = {}
    if mp == "bf16":
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if offload:
        kw["offload_policy"] = CPUOffloadPolicy(pin_memory=True)
    for blk in model.blocks:
        fully_shard(blk, **kw)
    fully_shard(model, **kw)
    if optimizer == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    rank = dist.get_rank()
    torch.manual_seed(1 + rank)  # each rank its own batch
    idx = torch.randint(0, vocab, (batch, seq + 1), device=dev)
    x, y = idx[:, :-1], idx[:, 1:]
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(warmup + steps):
        t0 = time.perf_counter()
        loss = F.cross_entropy(model(x).float().view(-1, vocab), y.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()
        if cuda:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    ms = statistics.median(times[warmup:])
    out = {
        "peer": "torch-fsdp2",
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "model": name,
        "world": dist.get_world_size(),
        "threads_per_rank": torch.get_num_threads(),
        "optimizer": optimizer,
        "batch": batch,
        "seq": seq,
        "mixed_precision": mp,
        "tf32": torch.backends.cuda.matmul.allow_tf32,
        "cpu_offload": offload,
        "params": sum(p.numel() for p in model.parameters()),
        "step_ms_median": ms,
        "tokens_per_s": dist.get_world_size() * batch * seq / ms * 1e3,
        "peak_allocated_bytes": torch.cuda.max_memory_allocated() if cuda else None,
    }
    del model, opt
    if cuda:
        torch.cuda.empty_cache()
    return out


def rank_main(rank, a):
    """One rank: its process group, every configuration, rank 0 prints."""
    if a.device == "cuda":
        torch.cuda.set_device(0)
    else:
        torch.set_num_threads(a.threads)
    dist.init_process_group("nccl" if a.device == "cuda" else "gloo", rank=rank, world_size=a.world)
    try:
        for cfg in a.config or ["mini"]:
            parts = cfg.split(":")
            batch = next((int(s[1:]) for s in parts[1:] if s.startswith("b") and s[1:].isdigit()), None)
            mp = "bf16" if "bf16" in parts else "none"
            torch.backends.cuda.matmul.allow_tf32 = "tf32" in parts
            batch = batch or a.batch
            r = run(parts[0], mp, "offload" in parts, batch, a.steps, a.warmup, a.device, a.optimizer)
            if rank == 0:
                print(json.dumps(r), flush=True)
    finally:
        dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--config",
        action="append",
        help="MODEL[:bf16][:tf32][:offload][:bBATCH], MODEL one of mini, small, gpt2 (repeatable)",
    )
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--world", type=int, default=1, help="ranks (processes); more than 1 only with --device cpu")
    p.add_argument("--threads", type=int, default=0, help="CPU intra-op threads per rank (default: max(1, cores / world))")
    p.add_argument("--batch", type=int, default=0, help="sequences per rank (default: the model's; :bBATCH overrides)")
    p.add_argument("--optimizer", choices=["sgd", "adamw"], default="sgd")
    a = p.parse_args()
    if a.world < 1 or (a.world > 1 and a.device != "cpu"):
        p.error("--world N > 1 needs --device cpu (one GPU per process: use torchrun for more)")
    if a.threads <= 0:
        a.threads = max(1, (os.cpu_count() or 1) // a.world)
    a.batch = a.batch or None
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    if a.world == 1:
        rank_main(0, a)
    else:
        import torch.multiprocessing as tmp

        tmp.spawn(rank_main, args=(a,), nprocs=a.world, join=True)


if __name__ == "__main__":
    main()
