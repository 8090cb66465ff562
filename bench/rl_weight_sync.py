"""RL weight sync: rank 0 (trainer) sends a whole model-shaped bf16 state dict
to rank 1 (inference) as one batch (every parameter tensor as it is, no
flattening copy): torch.distributed's batch_isend_irecv vs ours (one
isend/irecv group: the tensors compress in a few launches and travel in waves).

    python bench/rl_weight_sync.py [--model 1b|8b] [--link nvlink-1ch] [--json out.json]
"""
import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/pzbench, under python -P too
from pzbench import comm as comm_bench  # noqa: E402
from pzbench.common import report  # noqa: E402

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


def worker(rank, world, model, reps):
    device = torch.device("cuda", rank) if dist.get_backend() == "nccl" else torch.device("cpu")
    sd = list(state_dict(model, device).values())
    result = {"tensors": len(sd), "bytes": sum(t.nbytes for t in sd)}
    result.update(comm_bench.p2p_modes(rank, sd, reps))
    return result


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="1b", choices=sorted(MODELS))
    p.add_argument("--link", default="nvlink-1ch", choices=sorted(comm_bench.LINKS))
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    res = comm_bench.spawn(2, worker, a.model, a.reps, env=comm_bench.LINKS[a.link])
    res.update(model=a.model, link=a.link)
    report(res, a.json)


if __name__ == "__main__":
    main()
