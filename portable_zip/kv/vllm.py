"""A vLLM KV connector over portable_zip.kv (docs/KV.md, "vLLM"): push,
layer by layer, from prefill to decode.

    kv_transfer_config={"kv_connector": "PzKVConnector",
                        "kv_connector_module_path": "portable_zip.kv.vllm",
                        "kv_role": "kv_producer" | "kv_consumer" | "kv_both",
                        "kv_rank": <this instance's index>,
                        "kv_connector_extra_config": {"pz_prefill_ranks": [0], "pz_decode_ranks": [1, 2, 3]}}

The proxy puts {"do_remote_decode": True, "pz_decode_rank": d} (and
optionally "pz_transfer_id") in the prefill request's kv_transfer_params;
the prefill's finished request returns the decode request's params
({"do_remote_prefill": True, "pz_transfer_id", "pz_prefill_rank"}). Prefill
workers post each layer's blocks from save_kv_layer as the layer is computed
(chunked prefill posts each chunk's blocks); decode workers receive
asynchronously (get_num_new_matched_tokens answers (n, True)) and report the
request from get_finished; a failed load reports its blocks from
get_block_ids_with_load_errors, so vLLM recomputes them.

Instances index the KV world: worker (instance i, TP rank t) is rank
i * tp_size + t of the Communicator, and each prefill worker sends to the
decode worker of its own TP rank (equal TP sizes). The Communicator is
pz.Communicator over torch's default group, or what the callable named by
extra config "pz_communicator" ("module:function", called with the
vllm_config) returns: one Communicator, or (sender's, receiver's). vLLM is imported lazily: this module
imports without it; PzKVConnector is built on first access."""
from __future__ import annotations

import dataclasses
import importlib
import logging
from typing import Any

_log = logging.getLogger(__name__)
_BASE = "vllm.distributed.kv_transfer.kv_connector.v1.base"
_classes: dict = {}


@dataclasses.dataclass
class SaveSpec:
    """One scheduled prefill chunk to push: tokens [start, end) of a prompt of prompt_len."""
    request_id: str
    transfer_id: str
    dst: int
    block_ids: list
    start: int
    end: int
    prompt_len: int


@dataclasses.dataclass
class LoadSpec:
    """A decode request whose blocks block_ids (its logical blocks first_block on) arrive from src."""
    request_id: str
    transfer_id: str
    src: int
    block_ids: list
    first_block: int


def _meta_class():
    base = importlib.import_module(_BASE)

    @dataclasses.dataclass
    class PzKVConnectorMetadata(base.KVConnectorMetadata):
        saves: list = dataclasses.field(default_factory=list)
        loads: list = dataclasses.field(default_factory=list)
    return PzKVConnectorMetadata


def _connector_class():
    base = importlib.import_module(_BASE)
    Meta = _meta_class()

    class PzKVConnector(base.KVConnectorBase_V1):
        """vLLM's KVConnectorBase_V1 over portable_zip.kv: the scheduler side
        plans per step, the worker side moves blocks."""

        def __init__(self, vllm_config, role, kv_cache_config=None):
            try:
                super().__init__(vllm_config, role, kv_cache_config)
            except TypeError:  # vLLM before kv_cache_config joined the constructor
                super().__init__(vllm_config, role)
            cfg = vllm_config.kv_transfer_config
            self._cfg, self._extra = cfg, dict(cfg.kv_connector_extra_config or {})
            self._block_size = vllm_config.cache_config.block_size
            self._tp = vllm_config.parallel_config.tensor_parallel_size
            self._instance = int(cfg.kv_rank or 0)
            self._producer = cfg.kv_role in ("kv_producer", "kv_both")
            self._consumer = cfg.kv_role in ("kv_consumer", "kv_both")
            self._is_scheduler = role == base.KVConnectorRole.SCHEDULER
            # scheduler side
            self._sends = {}       # request_id -> SaveSpec template (block table grows with chunks)
            self._loads = []       # LoadSpecs of this step
            self._loading = set()  # decode requests whose load was planned
            # worker side
            self._layers, self._index = [], {}
            self._comms, self._tx, self._rx = [], None, None
            self._started, self._recving, self._load_errors = set(), {}, set()

        # --- scheduler side ------------------------------------------------------
        def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
            p = request.kv_transfer_params or {}
            if not (self._consumer and p.get("do_remote_prefill")) or request.request_id in self._loading:
                return 0, False
            n = len(request.prompt_token_ids) - num_computed_tokens
            return (n, True) if n > 0 else (0, False)

        def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
            p = request.kv_transfer_params or {}
            rid = request.request_id
            if self._producer and p.get("do_remote_decode") and rid not in self._sends:
                if "pz_decode_rank" not in p:
                    raise ValueError(f"request {rid!r}: kv_transfer_params has do_remote_decode but no "
                                     "pz_decode_rank (the proxy picks the decode instance)")
                self._sends[rid] = SaveSpec(rid, str(p.get("pz_transfer_id", rid)), int(p["pz_decode_rank"]), [],
                                            0, 0, len(request.prompt_token_ids))
            if self._consumer and p.get("do_remote_prefill") and num_external_tokens > 0:
                local = request.num_computed_tokens // self._block_size  # a local prefix hit stays
                ids = list(blocks.get_block_ids()[0])[local:]
                self._loads.append(LoadSpec(rid, str(p["pz_transfer_id"]), int(p["pz_prefill_rank"]), ids, local))
                self._loading.add(rid)

        def build_connector_meta(self, scheduler_output):
            meta = Meta(loads=self._loads)
            self._loads = []
            steps = [(r.req_id, r.block_ids, r.num_computed_tokens) for r in scheduler_output.scheduled_new_reqs]
            cached = scheduler_output.scheduled_cached_reqs
            steps += [(rid, cached.new_block_ids[i], cached.num_computed_tokens[i])
                      for i, rid in enumerate(cached.req_ids)]
            for rid, new_ids, computed in steps:
                spec = self._sends.get(rid)
                if spec is None:
                    continue
                if new_ids:
                    spec.block_ids.extend(new_ids[0])
                end = min(computed + scheduler_output.num_scheduled_tokens[rid], spec.prompt_len)
                if computed < end:
                    meta.saves.append(dataclasses.replace(spec, block_ids=list(spec.block_ids), start=computed,
                                                          end=end))
            return meta

        def request_finished(self, request, block_ids):
            rid = request.request_id
            self._loading.discard(rid)
            spec = self._sends.pop(rid, None)
            if spec is None:
                return False, None
            # The blocks were copied out as each layer was saved: vLLM may free them now.
            return False, {"do_remote_prefill": True, "do_remote_decode": False, "pz_transfer_id": spec.transfer_id,
                           "pz_prefill_rank": self._instance, "pz_decode_rank": spec.dst}

        # --- worker side ---------------------------------------------------------
        def register_kv_caches(self, kv_caches: dict):
            from . import KVLayer, KVReceiver, KVSender
            self._index = {name: i for i, name in enumerate(kv_caches)}
            self._layers = [KVLayer(kv=t) for t in kv_caches.values()]
            tx_comm, rx_comm = self._communicators()
            tp_rank = tx_comm.rank % self._tp
            if self._producer:
                self._tx = KVSender(tx_comm, [d * self._tp + tp_rank for d in self._extra["pz_decode_ranks"]])
            if self._consumer:
                self._rx = KVReceiver(rx_comm, [p * self._tp + tp_rank for p in self._extra["pz_prefill_ranks"]])

        def _communicators(self):
            make = self._extra.get("pz_communicator")
            if make:
                mod, _, fn = make.partition(":")
                got = getattr(importlib.import_module(mod), fn)(self._vllm_config)
            else:
                from ..comm import Communicator
                got = Communicator(compress=self._extra.get("pz_compress", "auto"),
                                   timeout=self._extra.get("pz_timeout"))
            pair = tuple(got) if isinstance(got, (tuple, list)) else (got, got)
            self._comms = list({id(c): c for c in pair}.values())
            if pair[0].rank // self._tp != self._instance:
                raise ValueError(f"Communicator rank {pair[0].rank} is not a worker of instance kv_rank="
                                 f"{self._instance} with tensor_parallel_size={self._tp}")
            return pair

        def _peer(self, instance: int) -> int:
            return instance * self._tp + self._comms[0].rank % self._tp

        def start_load_kv(self, forward_context, **kwargs: Any) -> None:
            for spec in self._get_connector_metadata().loads:
                try:
                    h = self._rx.recv(spec.transfer_id, self._peer(spec.src), self._layers, spec.block_ids,
                                      first_block=spec.first_block)
                except (KeyError, ValueError, RuntimeError) as e:
                    _log.error("pz KV: request %s cannot load: %s", spec.request_id, e)
                    self._load_errors.update(spec.block_ids)
                    self._recving[spec.request_id] = (None, spec.block_ids)
                    continue
                self._recving[spec.request_id] = (h, spec.block_ids)

        def wait_for_layer_load(self, layer_name: str) -> None:
            return  # loads are asynchronous: a request runs only once get_finished reported it

        def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
            if not self._producer or not self.has_connector_metadata():
                return
            layer = self._index[layer_name]
            bs = self._block_size
            for s in self._get_connector_metadata().saves:
                try:
                    if s.transfer_id not in self._started:
                        self._tx.start(s.transfer_id, self._peer(s.dst), len(self._layers))
                        self._started.add(s.transfer_id)
                    b0, b1 = s.start // bs, (s.end - 1) // bs + 1
                    self._tx.send_layer(s.transfer_id, layer, kv_layer, s.block_ids[b0:b1], first_block=b0,
                                        final=s.end >= s.prompt_len)
                except Exception as e:  # noqa: BLE001 - a failed push fails that request's decode, not the engine
                    _log.error("pz KV: request %s (transfer %s) not sent: %s", s.request_id, s.transfer_id, e)
                    if s.end >= s.prompt_len:
                        self._started.discard(s.transfer_id)

        def wait_for_save(self):
            # Each layer's blocks were copied out (queued on the forward's stream) in save_kv_layer.
            if self.has_connector_metadata():
                for s in self._get_connector_metadata().saves:
                    if s.end >= s.prompt_len:
                        self._started.discard(s.transfer_id)

        def get_finished(self, finished_req_ids):
            done = set()
            for rid, (h, ids) in list(self._recving.items()):
                if h is None or h.done():
                    del self._recving[rid]
                    done.add(rid)
                    if h is not None and h.error is not None:
                        _log.error("pz KV: request %s failed to load: %s", rid, h.error)
                        self._load_errors.update(ids)
            return None, done or None

        def get_block_ids_with_load_errors(self) -> set:
            out, self._load_errors = self._load_errors, set()
            return out

        def shutdown(self):
            try:
                if self._tx is not None:
                    self._tx.close()
                if self._rx is not None:
                    self._rx.close()
            finally:
                for c in self._comms:
                    c.close()
                self._comms = []

    PzKVConnector.Metadata = Meta
    return PzKVConnector


def __getattr__(name: str):
    if name == "PzKVConnector":
        if name not in _classes:
            _classes[name] = _connector_class()
        return _classes[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
