"""KV-cache transfer (prefill -> decode disaggregation): rank 0 sends the
paged KV blocks of one long prompt to rank 1 (every layer's K and V as one
batch), torch.distributed's batch_isend_irecv vs ours (one isend/irecv group).
Shapes of Llama-3.1-8B: 32 layers, 8 KV heads of 128, 16-token blocks.

    python bench/kv_transfer.py [--tokens 8192] [--link nvlink-1ch] [--json out.json]
"""
import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/pzbench, under python -P too
from pzbench import comm as comm_bench  # noqa: E402
from pzbench.common import report  # noqa: E402

LAYERS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16


def kv_cache(tokens, device):
    """K and V per layer as [blocks, block_size, kv_heads, head_dim] bf16, with
    per-channel scales (a few outlier channels in K) like real activations."""
    g = torch.Generator(device="cpu").manual_seed(0)
    blocks = tokens // BLOCK
    out = []
    for _ in range(LAYERS):
        k_scale = torch.exp(torch.randn(KV_HEADS, HEAD_DIM, generator=g) * 0.8)
        v_scale = torch.exp(torch.randn(KV_HEADS, HEAD_DIM, generator=g) * 0.3) * 0.5
        k = torch.randn(blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=g) * k_scale
        v = torch.randn(blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=g) * v_scale
        out += [k.to(torch.bfloat16).to(device), v.to(torch.bfloat16).to(device)]
    return out


def worker(rank, world, tokens, reps):
    device = torch.device("cuda", rank) if dist.get_backend() == "nccl" else torch.device("cpu")
    kv = kv_cache(tokens, device)
    result = {"tokens": tokens, "bytes": sum(t.nbytes for t in kv), "tensors": len(kv)}
    result.update(comm_bench.p2p_modes(rank, kv, reps))
    return result


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--link", default="nvlink-1ch", choices=sorted(comm_bench.LINKS))
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    res = comm_bench.spawn(2, worker, a.tokens, a.reps, env=comm_bench.LINKS[a.link])
    res["link"] = a.link
    report(res, a.json)


if __name__ == "__main__":
    main()
