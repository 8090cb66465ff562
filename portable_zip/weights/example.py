"""The example `python -m portable_zip.weights` runs: weight sync on two local CPU
processes (gloo). Rank 0 trains a small model with AdamW and sends its bf16
weights after each step; rank 1 receives them in place. Prints what each
round sent and why."""
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from portable_zip.comm import Communicator
from portable_zip.weights import Receiver, Sender
from portable_zip.weights.wire import checksum


def net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256))


def run(rank, port, steps):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    comm = Communicator(compress="always", timeout=60)
    model = net()
    bf16 = {n: p.detach().to(torch.bfloat16) for n, p in model.named_parameters()}
    if rank == 0:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
        sender = Sender(comm)
        for step in range(steps):
            if step:
                loss = model(torch.randn(64, 256)).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
            bf16 = {n: p.detach().to(torch.bfloat16) for n, p in model.named_parameters()}
            (st,) = sender.send(bf16, version=step)
            raw = sum(t.numel() * 2 for t in bf16.values())
            why = sorted({f["reason"] for f in st["fallbacks"]})
            print(f"step {step}: {st['delta']} delta / {st['full']} full chunks, {st['sent_bytes']:,} of {raw:,} "
                  f"raw bytes handed to the Communicator{'; full because: ' + ', '.join(why) if why else ''}")
    else:
        bf16 = {n: torch.zeros_like(t) for n, t in bf16.items()}
        receiver = Receiver(comm)
        for _ in range(steps):
            receiver.receive(bf16)
    # every tensor's checksum on both ranks: the receiver's copy is the sender's, bit for bit
    sums = torch.tensor([checksum(t) for t in bf16.values()], dtype=torch.int64)
    theirs = sums.clone()
    dist.broadcast(theirs, src=1)
    if rank == 0:
        print("receiver matches the sender bit for bit" if torch.equal(sums, theirs) else "MISMATCH")
    comm.close()
    dist.barrier()  # both ranks past every op before either tears down
    dist.destroy_process_group()


DEFAULT_STEPS = 4


def main(steps: int = DEFAULT_STEPS) -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(run, args=(port, steps), nprocs=2)
    return 0

