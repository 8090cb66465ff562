"""RL weight sync: rank 0 (trainer) sends a whole model-shaped bf16 state dict
to rank 1 (inference), in flattened buckets, raw (torch.distributed) vs ours.

    python bench/rl_weight_sync.py [--model 1b|8b] [--link nvlink-1ch] [--json out.json]
"""
import argparse

import torch
import torch.distributed as dist

from portable_zip import comm_bench
from portable_zip.benchmarks import report

MODELS = {  # hidden, layers, ffn, vocab, kv_heads, heads  (Llama-3.2-1B, Llama-3.1-8B)
    "1b": (2048, 16, 8192, 128256, 8, 32),
    "8b": (4096, 32, 14336, 128256, 8, 32),
}


def state_dict(model, device):
    h, layers, ffn, vocab, kvh, heads = MODELS[model]
    hd = h // heads
    g = torch.Generator(device="cpu").manual_seed(0)

    def w(*shape, std):
        return (torch.randn(*shape, generator=g) * std).to(torch.bfloat16).to(device)

    sd = {"embed": w(vocab, h, std=0.02)}
    for i in range(layers):
        sd[f"{i}.q"] = w(h, h, std=0.02)
        sd[f"{i}.k"] = w(kvh * hd, h, std=0.02)
        sd[f"{i}.v"] = w(kvh * hd, h, std=0.01)
        sd[f"{i}.o"] = w(h, h, std=0.02 / (2 * layers) ** 0.5)
        sd[f"{i}.gate"] = w(ffn, h, std=0.02)
        sd[f"{i}.up"] = w(ffn, h, std=0.02)
        sd[f"{i}.down"] = w(h, ffn, std=0.02 / (2 * layers) ** 0.5)
        sd[f"{i}.ln1"] = (1 + w(h, std=0.1).float()).to(torch.bfloat16)
        sd[f"{i}.ln2"] = (1 + w(h, std=0.1).float()).to(torch.bfloat16)
    sd["norm"] = torch.ones(h, dtype=torch.bfloat16, device=device)
    sd["lm_head"] = w(vocab, h, std=0.02)
    return sd


def buckets(tensors, cap):
    out, cur, n = [], [], 0
    for t in tensors:
        if cur and n + t.numel() > cap:
            out.append(cur)
            cur, n = [], 0
        cur.append(t)
        n += t.numel()
    return out + ([cur] if cur else [])


def worker(rank, world, model, bucket_mib, reps):
    device = torch.device("cuda", rank) if dist.get_backend() == "nccl" else torch.device("cpu")
    sd = state_dict(model, device)
    groups = buckets(list(sd.values()), bucket_mib << 19)
    flat = [torch.cat([t.reshape(-1) for t in g]) for g in groups]  # the trainer's flattened buckets
    result = {"tensors": len(sd), "bytes": sum(f.nbytes for f in flat), "buckets": len(flat)}
    result.update(comm_bench.p2p_modes(rank, flat, reps))
    return result


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="1b", choices=sorted(MODELS))
    p.add_argument("--link", default="nvlink-1ch", choices=sorted(comm_bench.LINKS))
    p.add_argument("--bucket-mib", type=int, default=512)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    res = comm_bench.spawn(2, worker, a.model, a.bucket_mib, a.reps, env=comm_bench.LINKS[a.link])
    res.update(model=a.model, link=a.link)
    report(res, a.json)


if __name__ == "__main__":
    main()
