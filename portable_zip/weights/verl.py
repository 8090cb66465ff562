"""A verl checkpoint engine over pz.weights (docs/WEIGHTS.md, "verl").

Registered as backend "portable_zip" in verl's CheckpointEngineRegistry
(verl 0.9: select it with actor_rollout_ref.rollout.checkpoint_engine.backend=
portable_zip and custom_backend_module=portable_zip.weights.verl). Actor rank
0 is the Sender; the other actor ranks drain their generator (its production
is collective); every rollout worker is a Receiver. The group is built once
and kept across steps (rebuild_group=True rebuilds it each step).

verl is imported lazily: this module imports without it, and importing it
where verl is present registers the engine."""
from __future__ import annotations

import asyncio
import importlib
import queue
import threading
from typing import Optional

import torch

from . import connect
from .engine import Receiver, Sender

BACKEND = "portable_zip"
_classes: dict = {}


def engine_class(base=None):
    """The engine class over verl's CheckpointEngine (or `base`, same protocol)."""
    if base is None:
        base = importlib.import_module("verl.checkpoint_engine.base").CheckpointEngine
    if base in _classes:
        return _classes[base]

    class PZCheckpointEngine(base):
        wire_format = "named_tensors"

        def __init__(self, bucket_size: int, is_master: bool = False, *, keep_base: Optional[str] = "cpu",
                     delta: bool = True, compress: str = "auto", transport: str = "auto", timeout: float = 300.0,
                     max_sms: Optional[int] = None, device=None, rebuild_group: bool = False, **_ignored):
            self.bucket_size, self.is_master = int(bucket_size), is_master
            self.opts = dict(keep_base=keep_base, delta=delta, max_sms=max_sms)
            self.wire = dict(device=device, timeout=timeout, compress=compress, transport=transport, max_sms=max_sms)
            self.rebuild_group = rebuild_group
            self.comm = self.engine = self.where = self.where_key = None
            self.rank, self.steps = -1, 0

        def prepare(self):
            """This worker's metadata: the master (actor rank 0) names the store's address."""
            if not self.is_master:
                return {"master": None}
            if self.where is None:
                self.where = (connect.host_address(), connect.free_port())
            return {"master": {"address": self.where[0], "port": self.where[1]}}

        @classmethod
        def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list):
            master = metadata[0]["master"]
            world = 1 + rollout_world_size
            actor = {"rank": [0] + [-1] * (actor_wg_world_size - 1), "world_size": [world] * actor_wg_world_size,
                     "master_metadata": [master] * actor_wg_world_size}
            rollout = {"rank": list(range(1, world)), "world_size": [world] * rollout_world_size,
                       "master_metadata": [master] * rollout_world_size}
            return actor, rollout

        def init_process_group(self, rank: int, world_size: int, master_metadata: dict, **_ignored):
            self.rank = rank
            key = (master_metadata["address"], master_metadata["port"], world_size)
            if rank < 0 or (self.comm is not None and key == self.where_key):
                return
            if self.comm is not None:
                connect.close(self.comm)
            self.where_key = key
            self.comm = connect.communicator(key[0], key[1], rank, world_size, **self.wire)
            if self.engine is not None and (rank == 0) == isinstance(self.engine, Sender):
                self.engine.comm = self.comm  # a rebuilt group: the kept base and held versions stay
            else:
                self.engine = (Sender(self.comm, bucket_bytes=self.bucket_size, part_bytes=self.bucket_size,
                                      **self.opts) if rank == 0 else Receiver(self.comm, **self.opts))

        def finalize(self):
            if self.rebuild_group and self.comm is not None:
                connect.close(self.comm)
                self.comm = self.where = self.where_key = None  # next step: a fresh port

        async def send_weights(self, weights, global_steps: Optional[int] = None):
            """Actor rank 0 sends (in parts of bucket_size, so the generator's
            tensors are held one part at a time); other actor ranks drain."""
            self.steps += 1
            version = self.steps if global_steps is None else int(global_steps)
            if self.rank != 0:
                for _ in weights:
                    pass
                return {}
            # On this thread: the generator's production may run collectives on the current device.
            stats = self.engine.send(weights, version)
            return {"pz/delta_chunks": float(sum(p["delta"] for p in stats)),
                    "pz/full_chunks": float(sum(p["full"] for p in stats)),
                    "pz/sent_bytes": float(sum(p["sent_bytes"] for p in stats)),
                    "pz/seconds": float(sum(p["seconds"] for p in stats))}

        def receive_weights(self, global_steps: Optional[int] = None):
            """An async generator of (name, tensor), a bucket at a time. With
            keep_base the tensors are the kept copies: load or copy them, do
            not modify them."""
            return _received(self.engine)

        def stats(self) -> list:
            return list(self.engine.history) if self.engine else []

    _classes[base] = PZCheckpointEngine
    return PZCheckpointEngine


async def _received(receiver):
    """The receiver's round on a thread, its buckets handed over through a queue."""
    q: queue.Queue = queue.Queue()  # never blocks the round: a bucket's tensors exist anyway
    end = object()

    def run():
        try:
            if receiver.comm.device.type == "cuda":
                torch.cuda.set_device(receiver.comm.device)  # a new thread starts on device 0
            receiver.receive(lambda pairs: q.put(list(pairs)))
            q.put(end)
        except BaseException as e:  # noqa: BLE001 - re-raised in the consumer
            q.put(e)

    threading.Thread(target=run, daemon=True).start()
    while True:
        item = await asyncio.to_thread(q.get)
        if item is end:
            return
        if isinstance(item, BaseException):
            raise item
        for pair in item:
            yield pair


def register(registry=None, base=None):
    """Register the engine as "portable_zip" (idempotent)."""
    if registry is None:
        registry = importlib.import_module("verl.checkpoint_engine.base").CheckpointEngineRegistry
    cls = engine_class(base)
    if registry._registry.get(BACKEND) is not cls:
        registry.register(BACKEND)(cls)
    return cls


try:  # custom_backend_module=portable_zip.weights.verl registers on import where verl is present
    importlib.import_module("verl.checkpoint_engine.base")
except ImportError:
    pass
else:
    register()
