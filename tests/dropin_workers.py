"""Per-rank bodies of tests/test_dropin_training*.py: training programs that
switch to the "pz" backend by their process group alone. The data-parallel
ones are tests/harness/training.py's runs; here, a 2-stage pipeline
(torch.distributed.pipelining: PipelineStage + Schedule1F1B or ScheduleGPipe)
whose activations and their gradients travel by send/recv."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from harness.training import VOCAB, Run, batch, build_model, deterministic, fingerprint, group_stats, on_world

# Microbatches of 32 sequences: 32 x 16 x 64 fp32 activations = 128 KiB per transfer each way.
PIPE_BATCH, MICROBATCHES = 128, 4


class FirstStage(nn.Module):
    def __init__(self, lm):
        super().__init__()
        self.embed, self.pos, self.block = lm.embed, lm.pos, lm.blocks[0]

    def forward(self, tokens):
        return self.block(self.embed(tokens) + self.pos[: tokens.shape[1]])


class LastStage(nn.Module):
    def __init__(self, lm):
        super().__init__()
        self.block, self.ln_f, self.head = lm.blocks[1], lm.ln_f, lm.head

    def forward(self, x):
        return self.head(self.ln_f(self.block(x)))


def _loss(logits, targets):
    return F.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1))


def pipeline_one(rank: int, run: Run) -> dict:
    """run.wrapping "1f1b" or "gpipe": the seeded 2-layer model cut after its
    first block, stage = rank, AdamW per stage. Per step: this stage's
    parameter fingerprint (and values), the last stage's microbatch losses;
    the world's stats where it has them."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
    if dist.get_world_size() != 2:
        raise ValueError(f"the pipeline runs 2 stages on 2 ranks, not {dist.get_world_size()}")
    lm = build_model(run.seed, run.device)
    module = (FirstStage if rank == 0 else LastStage)(lm)
    stage = PipelineStage(module, rank, 2, torch.device(run.device))
    kind = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}[run.wrapping]
    schedule = kind(stage, n_microbatches=MICROBATCHES, loss_fn=_loss)
    opt = torch.optim.AdamW(module.parameters(), lr=3e-3, weight_decay=0.01)
    out = {"fingerprints": [], "losses": [], "values": []}
    for step in range(run.steps):
        x, y = batch(run.seed, 0, step, run.device, size=PIPE_BATCH)  # one data stream: no data parallelism
        opt.zero_grad(set_to_none=True)
        if rank == 0:
            schedule.step(x)
        else:
            losses = []
            schedule.step(target=y, losses=losses)
            out["losses"].append([float(v.detach()) for v in losses])
        opt.step()
        params = [p.detach().contiguous() for p in module.parameters()]
        out["fingerprints"].append(fingerprint(params))
        if run.values:
            out["values"].append(torch.cat([p.float().reshape(-1) for p in params]).numpy())
    out["group_stats"] = group_stats({"world": dist.group.WORLD})
    return out


def pipeline(rank: int, world: int, runs) -> list:
    deterministic()
    return on_world(rank, world, runs, lambda r: pipeline_one(rank, r))
