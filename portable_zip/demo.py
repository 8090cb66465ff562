"""Demo: sync a model-shaped bf16 state dict from rank 0 to rank 1, raw and
compressed, between two local processes (2 GPUs over NCCL if present,
otherwise CPU over gloo). Rank 1 checks every tensor bit for bit."""
from __future__ import annotations

import os
import socket
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import portable_zip as pz


def state_dict(layers: int, hidden: int, vocab: int = 16_000, seed: int = 0) -> dict:
    """Llama-shaped parameters with per-tensor scales like a trained checkpoint."""
    g = torch.Generator().manual_seed(seed)
    ffn = int(hidden * 8 / 3) // 64 * 64

    def w(*shape, std):
        return (torch.randn(*shape, generator=g) * std).to(torch.bfloat16)

    sd = {"embed_tokens.weight": w(vocab, hidden, std=0.02)}
    for i in range(layers):
        p = f"layers.{i}."
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            sd[p + f"self_attn.{name}.weight"] = w(hidden, hidden, std=0.02 / (1 + i) ** 0.5)
        sd[p + "mlp.gate_proj.weight"] = w(ffn, hidden, std=0.015)
        sd[p + "mlp.up_proj.weight"] = w(ffn, hidden, std=0.015)
        sd[p + "mlp.down_proj.weight"] = w(hidden, ffn, std=0.01)
        sd[p + "input_layernorm.weight"] = (1 + w(hidden, std=0.05).float()).to(torch.bfloat16)
        sd[p + "post_attention_layernorm.weight"] = (1 + w(hidden, std=0.05).float()).to(torch.bfloat16)
    sd["norm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
    sd["lm_head.weight"] = w(vocab, hidden, std=0.02)
    return sd


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _progress(items, desc):
    try:
        from tqdm import tqdm

        return tqdm(items, desc=desc, unit="tensor")
    except ImportError:
        return items


def _worker(rank: int, world: int, port: int, layers: int, hidden: int, use_gpu: bool, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device("cuda", rank) if use_gpu else torch.device("cpu")
    if use_gpu:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if use_gpu else "gloo", rank=rank, world_size=world)
    sd = {k: v.to(device) for k, v in state_dict(layers, hidden).items()}
    tensors = list(sd.values())
    sync = torch.cuda.synchronize if use_gpu else (lambda: None)

    # Raw sync: every tensor as it is.
    dist.barrier()
    t0 = time.perf_counter()
    for t in tensors:
        dist.send(t, 1) if rank == 0 else dist.recv(t, 0)
    sync()
    raw_s = time.perf_counter() - t0

    # Compressed sync: sizes first (the receiver never guesses), then the streams.
    dist.barrier()
    t0 = time.perf_counter()
    if rank == 0:
        bufs = [pz.compress(t) for t in _progress(tensors, "compress + send")]
        sizes = torch.tensor([pz.compressed_size(b) for b in bufs], dtype=torch.int64, device=device)
        c_s = time.perf_counter() - t0
        dist.send(sizes, 1)
        for b, n in zip(bufs, sizes.tolist()):
            dist.send(b[:n], 1)
        sync()
        results["compress_s"] = c_s
        results["wire"] = int(sizes.sum())
    else:
        sizes = torch.empty(len(tensors), dtype=torch.int64, device=device)
        dist.recv(sizes, 0)
        got = []
        for n in sizes.tolist():
            b = torch.empty(n, dtype=torch.uint8, device=device)
            dist.recv(b, 0)
            got.append(b)
        t1 = time.perf_counter()
        outs = [pz.decompress(b) for b in got]
        sync()
        results["decompress_s"] = time.perf_counter() - t1
        results["exact"] = all(torch.equal(o.view(torch.int16), t.view(torch.int16)) for o, t in zip(outs, tensors))
    sync()
    dist.barrier()
    if rank == 0:
        results["compressed_s"] = time.perf_counter() - t0
        results["raw_s"] = raw_s
        results["raw"] = sum(t.nbytes for t in tensors)
        results["tensors"] = len(tensors)
    dist.destroy_process_group()


def run(layers: int = 4, hidden: int = 1024) -> int:
    use_gpu = torch.cuda.is_available() and torch.cuda.device_count() >= 2 and pz.backend_info()["backend"] != "cpu"
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    with mp.Manager() as m:
        results = m.dict()
        mp.spawn(_worker, args=(2, _free_port(), layers, hidden, use_gpu, results), nprocs=2, join=True)
        r = dict(results)
    link = "NCCL between 2 GPUs" if use_gpu else "gloo between 2 CPU processes (loopback)"
    gb = 1e9
    print(f"\nportable_zip demo: {r['tensors']} tensors of a {layers}-layer, hidden-{hidden} bf16 model, over {link}")
    print(f"  raw bytes        {r['raw'] / gb:8.3f} GB")
    print(f"  wire bytes       {r['wire'] / gb:8.3f} GB   ratio {r['wire'] / r['raw']:.4f} (compressed/original)")
    print(f"  compress         {r['raw'] / r['compress_s'] / gb:8.2f} GB/s   decompress {r['raw'] / r['decompress_s'] / gb:.2f} GB/s")
    print(f"  raw sync         {r['raw_s'] * 1e3:8.1f} ms   ({r['raw'] / r['raw_s'] / gb:.2f} GB/s)")
    print(f"  compressed sync  {r['compressed_s'] * 1e3:8.1f} ms   ({r['raw'] / r['compressed_s'] / gb:.2f} GB/s effective,"
          f" {r['raw_s'] / r['compressed_s']:.2f}x raw; codec time included)")
    print(f"  bit-exact on the receiver: {r['exact']}")
    return 0 if r["exact"] else 1
