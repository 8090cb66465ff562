"""Demo (python -m portable_zip demo): the codec alone on a model-shaped bf16
state dict, then a sync of it from rank 0 to rank 1, raw and compressed,
between two processes: 2 GPUs over NCCL if present; otherwise CPU over gloo
between two hosts on this machine (network namespaces joined by a link of
PZ_NETNS_GBIT, default 1 Gbit/s: portable_zip/netns.py) where root and
iproute2 allow, else over loopback. Every result is checked bit for bit."""
from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import portable_zip as pz
from portable_zip import netns

# A 2-core machine's CPU codec (about 2 Gbit/s of compressed sync) pays off
# below that; 1 Gbit/s is a commodity Ethernet or cloud cross-zone link.
DEMO_GBIT = 1.0


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


def _progress(items, desc, unit="tensor"):
    try:
        from tqdm import tqdm

        return tqdm(items, desc=desc, unit=unit)
    except ImportError:
        return items


def codec_speed(tensors: list, sync) -> dict:
    """Every tensor compressed, then decompressed into a preallocated tensor,
    one pass each, timed as a whole and checked bit for bit."""
    outs = [torch.empty_like(t) for t in tensors]
    small = min(range(len(tensors)), key=lambda i: tensors[i].numel())
    pz.decompress(pz.compress(tensors[small]), out=outs[small], check=True)  # warm-up: loads the device code
    sync()
    t0 = time.perf_counter()
    bufs = [pz.compress(t) for t in tensors]
    sync()
    t1 = time.perf_counter()
    for b, o in zip(bufs, outs):
        pz.decompress(b, out=o)
    sync()
    pz.check()  # raises if a queued GPU decode failed
    t2 = time.perf_counter()
    return {"codec_raw": sum(t.nbytes for t in tensors), "codec_compress_s": t1 - t0, "codec_decompress_s": t2 - t1,
            "codec_wire": sum(pz.compressed_size(b) for b in bufs),
            "codec_exact": all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(tensors, outs))}


def _worker(rank: int, world: int, init: str, layers: int, hidden: int, use_gpu: bool, codec_device: str,
            out_dir: str) -> None:
    """One rank: its results go to out_dir/rank<r>.json."""
    results = {}
    device = torch.device("cuda", rank) if use_gpu else torch.device("cpu")
    if use_gpu:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if use_gpu else "gloo", init_method=init, rank=rank, world_size=world)
    sd = state_dict(layers, hidden)
    dist.barrier()
    if rank == 0:  # 0. The codec alone, while rank 1 waits
        on_gpu = codec_device == "cuda"
        results.update(codec_speed([t.to(codec_device) for t in sd.values()],
                                   torch.cuda.synchronize if on_gpu else (lambda: None)),
                       codec_on=torch.cuda.get_device_name() if on_gpu else f"CPU, {torch.get_num_threads()} threads")
    dist.barrier()
    tensors = [t.to(device) for t in sd.values()]
    recv = [torch.empty_like(t) for t in tensors]
    sync = torch.cuda.synchronize if use_gpu else (lambda: None)
    comm = pz.Communicator(compress="always")

    def timed(fn):
        dist.barrier()
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        dist.barrier()
        return time.perf_counter() - t0

    # 1. Weight sync, rank 0 -> rank 1: plain torch.distributed, then compressed.
    def raw_sync():
        for t, r in zip(tensors, recv):
            dist.send(t, 1) if rank == 0 else dist.recv(r, 0)

    def zipped_sync():
        # Batches of tensors as isend/irecv groups: each group is one exchange
        # (one compress launch per wave), the progress bar ticks per group.
        mine = tensors if rank == 0 else recv
        groups = [mine[i: i + 8] for i in range(0, len(mine), 8)]
        post = comm.isend if rank == 0 else comm.irecv
        for group in (_progress(groups, "compressed sync", "batch") if rank == 0 else groups):
            for w in [post(t, 1 - rank) for t in group]:
                w.wait()

    results["raw_s"] = timed(raw_sync)
    results["compressed_s"] = timed(zipped_sync)
    if rank == 1:
        results["exact"] = all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(tensors, recv))
    else:
        s = comm.stats["send"]
        results.update(raw=s["raw_bytes"], wire=s["wire_bytes"], tensors=len(tensors))

    # 2. A compressed two-shot all_reduce of gradient-like tensors: every rank
    # must end with the same bytes.
    grad = (torch.randn(4 << 20, generator=torch.Generator().manual_seed(rank)) * 1e-3).to(torch.bfloat16).to(device)
    mine = grad.clone()
    results[f"allreduce_s_{rank}"] = timed(lambda: comm.all_reduce(mine))
    chunks = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(chunks, mine)
    if rank == 0:
        results["allreduce_identical"] = all(torch.equal(c.view(torch.int16), chunks[0].view(torch.int16))
                                             for c in chunks)
        a = comm.stats["all_reduce"]
        results["allreduce_ratio"] = a["wire_bytes"] / a["raw_bytes"]
    comm.close()
    dist.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)


def _merged(out_dir: str) -> dict:
    r = {}
    for rank in (0, 1):
        with open(os.path.join(out_dir, f"rank{rank}.json")) as f:
            r.update(json.load(f))
    return r


def _on_link(args: list, out_dir: str) -> tuple:
    """Both ranks in namespaces joined by a shaped link: (its description, its
    measured limit), or (None, why not) where it cannot be built."""
    why = netns.unavailable()
    if why:
        return None, why
    netns.exit_on_signals()  # a kill unwinds the with-block: no namespace left behind
    try:
        with netns.Link(2, gbit=netns.env_float("PZ_NETNS_GBIT", DEMO_GBIT)) as link:
            measured = link.measure()
            ranks = link.run([sys.executable, "-I", "-m", "portable_zip.demo", "_worker", json.dumps(args), out_dir],
                             timeout=600)
            if any(ranks.codes):
                raise RuntimeError(f"a demo rank failed (exit codes {ranks.codes})")
            return link.describe(), measured
    except netns.LinkError as e:
        return None, str(e)


def run(layers: int = 4, hidden: int = 1024) -> int:
    gpus = torch.cuda.device_count() if torch.cuda.is_available() and pz.backend_info()["backend"] != "cpu" else 0
    use_gpu = gpus >= 2
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    out_dir = tempfile.mkdtemp(prefix="pz-demo-")  # the ranks' results, and on loopback their rendezvous file
    args = [layers, hidden, use_gpu, "cuda" if gpus else "cpu"]
    try:
        shaped, measured = (None, None) if use_gpu else _on_link(args, out_dir)
        if shaped is None:
            if measured:
                print(f"portable_zip demo: over loopback, as no shaped link between namespaces can be made here: "
                      f"{measured}")
            mp.spawn(_worker, args=(2, "file://" + os.path.join(out_dir, "rendezvous"), *args, out_dir), nprocs=2,
                     join=True)
        r = _merged(out_dir)
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
    gb = 1e9
    if use_gpu:
        print("\nportable_zip demo over NCCL between 2 GPUs")
    elif shaped:
        print(f"\nportable_zip demo over gloo between {shaped}")
        print(f"  the link's limit, by plain TCP: {measured['gbit']:.2f} Gbit/s, "
              f"round trip {measured['rtt_us']:.0f} us")
    else:
        print("\nportable_zip demo over gloo between 2 CPU processes (loopback)")
    raw = r["codec_raw"]
    print(f"  codec alone on {r['codec_on']}: {raw / gb:.3f} GB of bf16 weights, ratio "
          f"{r['codec_wire'] / raw:.4f}, bit-exact: {r['codec_exact']}")
    print(f"    compress   {raw / r['codec_compress_s'] / gb:7.2f} GB/s   ({r['codec_compress_s'] * 1e3:.1f} ms)")
    print(f"    decompress {raw / r['codec_decompress_s'] / gb:7.2f} GB/s   ({r['codec_decompress_s'] * 1e3:.1f} ms)")
    print(f"  weight sync: {r['tensors']} tensors of a {layers}-layer, hidden-{hidden} bf16 model")
    print(f"    raw bytes        {r['raw'] / gb:8.3f} GB")
    print(f"    wire bytes       {r['wire'] / gb:8.3f} GB   ratio {r['wire'] / r['raw']:.4f} (compressed/original)")
    print(f"    torch.distributed {r['raw_s'] * 1e3:7.1f} ms   ({r['raw'] / r['raw_s'] / gb:.2f} GB/s"
          + (f", {r['raw'] * 8 / r['raw_s'] / measured['gbit'] / gb:.0%} of the link)" if shaped else ")"))
    print(f"    pz.Communicator  {r['compressed_s'] * 1e3:8.1f} ms   ({r['raw'] / r['compressed_s'] / gb:.2f} GB/s effective,"
          f" speedup {r['raw_s'] / r['compressed_s']:.2f}x; codec time included)")
    print(f"    bit-exact on the receiver: {r['exact']}")
    ar = max(r["allreduce_s_0"], r["allreduce_s_1"])
    print(f"  all_reduce of 4M bf16 gradients: {ar * 1e3:.1f} ms, wire ratio {r['allreduce_ratio']:.4f}, "
          f"ranks bit-identical: {r['allreduce_identical']}")
    if not use_gpu and not shaped:
        print("  (on CPU the codec runs on the host cores and is slower than loopback; over a real network\n"
              "   or between GPUs the same code pays off: see README, Measured)")
    return 0 if r["codec_exact"] and r["exact"] and r["allreduce_identical"] else 1


if __name__ == "__main__" and sys.argv[1:2] == ["_worker"]:  # one rank on the shaped link (_on_link)
    _worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), "env://", *json.loads(sys.argv[2]), sys.argv[3])
