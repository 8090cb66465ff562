"""A vLLM weight-transfer engine over pz.weights (docs/WEIGHTS.md, "vLLM").

Worker side: the engine class registered as backend "portable_zip" in
vLLM's WeightTransferEngineFactory (the 0.32+ worker API: __init__(config,
vllm_config, device, model); init_transfer_engine / start_weight_update /
receive_weights / finish_weight_update / shutdown). Each worker is one
Receiver; the trainer's rank 0 is the Sender. Received (name, tensor) pairs
(checkpoint names, full shapes) go to model.load_weights one bucket at a
time, inside vLLM's layerwise-reload bracket.

Trainer side: Trainer, which needs only vLLM's 4-method client protocol
(init_weight_transfer_engine / start_weight_update / update_weights /
finish_weight_update), so it works with vLLM's HTTP and Ray clients.

vLLM is imported lazily: this module imports without it. Select the engine
with WeightTransferConfig(backend="portable_zip"): portable_zip's package
declares the vllm.general_plugins entry point (plugin()) that registers it in
every vLLM process."""
from __future__ import annotations

import dataclasses
import importlib
import inspect
import threading
import warnings
from typing import Iterable, Optional

from . import connect
from .engine import Receiver, Sender

BACKEND = "portable_zip"
_classes: dict = {}


def _vllm(module: str):
    return importlib.import_module(module)


def supported(base) -> bool:
    """The 0.32+ worker API (verl's check: the four constructor arguments)."""
    return {"config", "vllm_config", "device", "model"} <= set(inspect.signature(base.__init__).parameters)


def engine_class(base=None):
    """The engine class over vLLM's WeightTransferEngine (or `base`, with the
    same protocol). One class per base."""
    wt = None
    if base is None:
        wt = _vllm("vllm.distributed.weight_transfer.base")
        base = wt.WeightTransferEngine
    if base in _classes:
        return _classes[base]
    if not supported(base):
        raise RuntimeError("portable_zip's vLLM engine needs vLLM's 0.32+ weight-transfer API (WeightTransferEngine"
                           "(config, vllm_config, device, model)); this vLLM has an older one")
    mod = wt or _vllm(base.__module__)
    init_base, update_base = mod.WeightTransferInitInfo, mod.WeightTransferUpdateInfo

    @dataclasses.dataclass
    class PZInitInfo(init_base):
        """Everything the wire needs (vLLM's config carries only the backend's name)."""
        master_address: str
        master_port: int
        world_size: int            # trainer sender + every vLLM worker
        rank_offset: int = 1       # this worker's rank = rank_offset + dp_rank * workers per replica + rank
        timeout: float = 300.0
        compress: str = "auto"
        transport: str = "auto"
        keep_base: Optional[str] = "cpu"  # a host copy of the checkpoint per worker, for deltas; None: full syncs
        delta: bool = True
        max_sms: Optional[int] = None

    @dataclasses.dataclass
    class PZUpdateInfo(update_base):
        version: int = 0           # informational: the sender's manifest carries the version

    class PZWeightTransferEngine(base):
        init_info_cls = PZInitInfo
        update_info_cls = PZUpdateInfo
        supports_draft_weight_update = False

        def __init__(self, config, vllm_config, device, model):
            super().__init__(config, vllm_config, device, model)
            self.receiver = self.comm = None

        def rank(self, info) -> int:
            pc = self.parallel_config
            dp = getattr(pc, "data_parallel_rank", 0) or 0
            return info.rank_offset + dp * pc.world_size + pc.rank

        def init_transfer_engine(self, init_info) -> None:
            if self.comm is not None:
                connect.close(self.comm)
            self.comm = connect.communicator(init_info.master_address, init_info.master_port, self.rank(init_info),
                                             init_info.world_size, device=self.device, timeout=init_info.timeout,
                                             compress=init_info.compress, transport=init_info.transport,
                                             max_sms=init_info.max_sms)
            self.receiver = Receiver(self.comm, keep_base=init_info.keep_base, delta=init_info.delta,
                                     max_sms=init_info.max_sms)

        def start_weight_update(self) -> None:
            reload = _vllm("vllm.model_executor.model_loader.reload")
            start = getattr(reload, "start_reload", None)
            start(self.model) if start else reload.initialize_layerwise_reload(self.model)

        def receive_weights(self, update_info) -> None:
            if self.receiver is None:
                raise RuntimeError("receive_weights before init_transfer_engine")
            self.receiver.receive(self.model.load_weights)

        def finish_weight_update(self) -> None:
            reload = _vllm("vllm.model_executor.model_loader.reload")
            finish = getattr(reload, "finish_reload", None)
            if finish:
                finish(self.model, self.model_config, self.device)
            else:
                reload.finalize_layerwise_reload(self.model, self.model_config)

        def shutdown(self) -> None:
            if self.comm is not None:
                connect.close(self.comm)
            self.comm = self.receiver = None

    _classes[base] = PZWeightTransferEngine
    return PZWeightTransferEngine


def register(factory=None, base=None) -> None:
    """Register the engine as backend "portable_zip" (idempotent: vLLM's
    register_engine raises on a name it holds, and plugins may run several
    times per process). plugin() calls it in every vLLM process."""
    if factory is None:
        factory = _vllm("vllm.distributed.weight_transfer.factory").WeightTransferEngineFactory
    if BACKEND in getattr(factory, "_registry", {}):
        return
    factory.register_engine(BACKEND, engine_class(base))


def plugin() -> None:
    """The vllm.general_plugins entry point that portable_zip's own package
    declares: vLLM runs it in every process. A vLLM without the 0.32+
    weight-transfer API gets a warning and is otherwise left as it is (a
    plugin that raises would stop vLLM from starting)."""
    try:
        register()
    except Exception as e:  # noqa: BLE001 (whatever this vLLM makes of the engine: vLLM must still start)
        warnings.warn(f"portable_zip: weight-transfer backend {BACKEND!r} not registered with vLLM: {e}",
                      RuntimeWarning, stacklevel=2)


class Trainer:
    """The trainer side: rank 0 of the weight world sends; the vLLM workers
    are ranks 1..world_size-1. client: anything with vLLM's 4 client methods
    (HTTPVLLMWeightSyncClient, RayVLLMWeightSyncClient, ...)."""

    def __init__(self, client, *, world_size: int, master_address: Optional[str] = None,
                 master_port: Optional[int] = None, timeout: float = 300.0, compress: str = "auto",
                 transport: str = "auto", keep_base: Optional[str] = "cpu", delta: bool = True,
                 max_sms: Optional[int] = None, bucket_bytes: int = 256 << 20, device=None):
        self.client = client
        address = master_address or connect.host_address()
        port = master_port or connect.free_port()
        self.init_info = {"master_address": address, "master_port": port, "world_size": world_size,
                          "rank_offset": 1, "timeout": timeout, "compress": compress, "transport": transport,
                          "keep_base": keep_base, "delta": delta, "max_sms": max_sms}
        # The workers connect while we do: the client's call blocks until they have.
        side = _side(client.init_weight_transfer_engine, self.init_info)
        try:
            self.comm = connect.communicator(address, port, 0, world_size, device=device, timeout=timeout,
                                             compress=compress, transport=transport, max_sms=max_sms)
        finally:
            side.result()
        self.sender = Sender(self.comm, bucket_bytes=bucket_bytes, keep_base=keep_base, delta=delta,
                             max_sms=max_sms)

    def send_weights(self, named_tensors: Iterable, version: int) -> list:
        """One update: start, then update_weights on the workers while we
        send, then finish. Returns the round's stats."""
        self.client.start_weight_update()
        side = _side(self.client.update_weights, {"version": int(version)})
        try:
            stats = self.sender.send(named_tensors, version)
        finally:
            side.result()
        self.client.finish_weight_update(weight_version=str(version))
        return stats

    def shutdown(self) -> None:
        connect.close(self.comm)


class _side:
    """fn(arg) on a thread; result() joins it and re-raises its exception."""

    def __init__(self, fn, arg):
        self.error = None
        self.thread = threading.Thread(target=self._run, args=(fn, arg), daemon=True)
        self.thread.start()

    def _run(self, fn, arg):
        try:
            fn(arg)
        except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread
            self.error = e

    def result(self):
        self.thread.join()
        if self.error is not None:
            raise self.error
