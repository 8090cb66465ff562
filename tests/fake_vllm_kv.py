"""A faithful stand-in for the parts of vLLM's KV-connector protocol (v1,
as of vLLM 0.11-0.13 and main in 2026) that portable_zip.kv.vllm touches,
installed as `vllm.*` modules where vLLM is absent (no CPU wheel). What it
mimics, from
- vllm/distributed/kv_transfer/kv_connector/v1/base.py: KVConnectorRole,
  KVConnectorMetadata, KVConnectorBase_V1 (__init__(vllm_config, role,
  kv_cache_config) keeping _vllm_config / _kv_transfer_config / _role,
  bind/clear/_get/has_connector_metadata);
- vllm/distributed/kv_transfer/kv_connector/factory.py: a connector not in
  the registry is kv_connector_module_path's attribute kv_connector;
- vllm/config/kv_transfer.py: KVTransferConfig's fields and is_kv_producer /
  is_kv_consumer;
- vllm/v1/core/sched/{scheduler,output}.py and vllm/v1/worker/
  kv_connector_model_runner_mixin.py: the call order of one engine step.
  Scheduler: get_num_new_matched_tokens for a waiting request; a positive
  async answer allocates the blocks, calls update_state_after_alloc and parks
  the request in WAITING_FOR_REMOTE_KVS until get_finished reports it (then
  num_computed_tokens = the loaded tokens, less one where that is the whole
  prompt, so the last token is recomputed; failed blocks are recomputed);
  otherwise update_state_after_alloc(request, blocks, 0) as it is scheduled;
  a token budget per step (chunked prefill); build_connector_meta(output) with
  scheduled_new_reqs (req_id, prompt_token_ids, block_ids as a tuple of
  lists, num_computed_tokens) and scheduled_cached_reqs (req_ids,
  new_block_ids, num_computed_tokens); request_finished(request, block_ids)
  once when a request ends, its kv_transfer_params returned to the client.
  Worker: bind_connector_metadata, start_load_kv, per layer
  wait_for_layer_load -> attention writes the step's tokens -> save_kv_layer
  (layer_name, the layer's [2, blocks, block_size, heads, head_dim] cache),
  wait_for_save, get_finished(finished_req_ids),
  get_block_ids_with_load_errors, clear_connector_metadata.
The attention is a stand-in: a token's K/V at (layer, position) are random
bits drawn from (seed, the prompt, position, layer), so two engines given the
same prompt compute the same bytes."""
import abc
import dataclasses
import enum
import importlib
import importlib.util
import sys
import types
from typing import Any, Optional

import numpy as np
import torch


# --- vllm.config ---------------------------------------------------------------
@dataclasses.dataclass
class KVTransferConfig:
    kv_connector: Optional[str] = None
    engine_id: Optional[str] = None
    kv_buffer_device: str = "cuda"
    kv_buffer_size: float = 1e9
    kv_role: Optional[str] = None
    kv_rank: Optional[int] = None
    kv_parallel_size: int = 1
    kv_ip: str = "127.0.0.1"
    kv_port: int = 14579
    kv_connector_extra_config: dict = dataclasses.field(default_factory=dict)
    kv_connector_module_path: Optional[str] = None

    @property
    def is_kv_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_kv_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")


@dataclasses.dataclass
class CacheConfig:
    block_size: int = 16


@dataclasses.dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1


@dataclasses.dataclass
class VllmConfig:
    kv_transfer_config: Optional[KVTransferConfig] = None
    cache_config: CacheConfig = dataclasses.field(default_factory=CacheConfig)
    parallel_config: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)


# --- vllm.distributed.kv_transfer.kv_connector.v1.base ---------------------------
class KVConnectorRole(enum.Enum):
    SCHEDULER = 0
    WORKER = 1


class KVConnectorMetadata(abc.ABC):  # noqa: B024
    pass


class KVConnectorBase_V1(abc.ABC):
    def __init__(self, vllm_config, role, kv_cache_config=None):
        self._connector_metadata = None
        self._vllm_config = vllm_config
        if vllm_config.kv_transfer_config is None:
            raise ValueError("kv_transfer_config must be set for KVConnectorBase_V1")
        self._kv_transfer_config = vllm_config.kv_transfer_config
        self._kv_cache_config = kv_cache_config
        self._role = role

    @property
    def role(self):
        return self._role

    def bind_connector_metadata(self, connector_metadata):
        self._connector_metadata = connector_metadata

    def clear_connector_metadata(self):
        self._connector_metadata = None

    def _get_connector_metadata(self):
        assert self._connector_metadata is not None
        return self._connector_metadata

    def has_connector_metadata(self) -> bool:
        return self._connector_metadata is not None

    def register_kv_caches(self, kv_caches):
        return

    @abc.abstractmethod
    def start_load_kv(self, forward_context, **kwargs): ...

    @abc.abstractmethod
    def wait_for_layer_load(self, layer_name): ...

    @abc.abstractmethod
    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs): ...

    @abc.abstractmethod
    def wait_for_save(self): ...

    def get_finished(self, finished_req_ids):
        return None, None

    def get_block_ids_with_load_errors(self):
        return set()

    def shutdown(self):
        return None

    @abc.abstractmethod
    def get_num_new_matched_tokens(self, request, num_computed_tokens): ...

    @abc.abstractmethod
    def update_state_after_alloc(self, request, blocks, num_external_tokens): ...

    @abc.abstractmethod
    def build_connector_meta(self, scheduler_output): ...

    def update_connector_output(self, connector_output):
        return

    def request_finished(self, request, block_ids):
        return False, None


# --- vllm.distributed.kv_transfer.kv_connector.factory ---------------------------
class KVConnectorFactory:
    _registry: dict = {}

    @classmethod
    def get_connector_class(cls, kv_transfer_config):
        name = kv_transfer_config.kv_connector
        if name in cls._registry:
            return cls._registry[name]()
        if kv_transfer_config.kv_connector_module_path is None:
            raise ValueError(f"Unsupported connector type: {name}")
        return getattr(importlib.import_module(kv_transfer_config.kv_connector_module_path), name)

    @classmethod
    def create_connector(cls, config, role, kv_cache_config=None):
        return cls.get_connector_class(config.kv_transfer_config)(config, role, kv_cache_config)


# --- the scheduler's and model runner's data -------------------------------------
class KVCacheBlocks:
    def __init__(self, ids):
        self.blocks = (list(ids),)

    def get_block_ids(self):
        return tuple(list(b) for b in self.blocks)


@dataclasses.dataclass
class NewRequestData:
    req_id: str
    prompt_token_ids: list
    block_ids: tuple
    num_computed_tokens: int


@dataclasses.dataclass
class CachedRequestData:
    req_ids: list
    new_block_ids: list
    num_computed_tokens: list


@dataclasses.dataclass
class SchedulerOutput:
    scheduled_new_reqs: list
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict
    total_num_scheduled_tokens: int
    finished_req_ids: set
    kv_connector_metadata: Any = None


@dataclasses.dataclass
class KVConnectorOutput:
    finished_sending: Optional[set] = None
    finished_recving: Optional[set] = None
    invalid_block_ids: set = dataclasses.field(default_factory=set)


class Request:
    def __init__(self, request_id, prompt_token_ids, max_tokens, kv_transfer_params=None):
        self.request_id, self.prompt_token_ids = request_id, list(prompt_token_ids)
        self.max_tokens, self.kv_transfer_params = max_tokens, kv_transfer_params
        self.num_computed_tokens, self.output_token_ids = 0, []
        self.status, self.blocks, self.new_blocks, self.seen = "WAITING", [], [], False
        self.loaded_tokens = 0
        self.computed_here, self.steps = 0, 0  # tokens this engine computed, steps that computed some
        self.out_params = None

    @property
    def num_tokens(self):
        return len(self.prompt_token_ids) + len(self.output_token_ids)


def token_kv(seed, prompt, pos, layer, heads, head_dim, dtype):
    """[2, heads, head_dim]: this engine's K/V of the token at pos (random bits)."""
    n = 2 * heads * head_dim * torch.empty(0, dtype=dtype).element_size()
    rng = np.random.default_rng([seed, hash(tuple(prompt)) & 0xFFFFFFFF, pos, layer])
    return torch.from_numpy(rng.integers(0, 256, n, dtype=np.uint8)).view(dtype).reshape(2, heads, head_dim)


class Engine:
    """One vLLM instance, TP 1: scheduler and model runner, each with its own connector."""

    def __init__(self, vllm_config, seed, layers=3, num_blocks=64, heads=2, head_dim=16, dtype=torch.bfloat16,
                 token_budget=24):
        self.cfg, self.seed, self.bs = vllm_config, seed, vllm_config.cache_config.block_size
        self.heads, self.head_dim, self.dtype, self.budget = heads, head_dim, dtype, token_budget
        self.kv_caches = {f"model.layers.{i}.self_attn.attn": torch.zeros(2, num_blocks, self.bs, heads, head_dim,
                                                                          dtype=dtype) for i in range(layers)}
        self.free = list(range(num_blocks - 1, -1, -1))
        self.sched = KVConnectorFactory.create_connector(vllm_config, KVConnectorRole.SCHEDULER)
        self.worker = KVConnectorFactory.create_connector(vllm_config, KVConnectorRole.WORKER)
        self.worker.register_kv_caches(self.kv_caches)
        self.requests, self.finished = [], []
        self.finished_ids = set()

    def add_request(self, req):
        self.requests.append(req)

    def _alloc(self, req, tokens):
        need = -(-tokens // self.bs) - len(req.blocks)
        new = [self.free.pop() for _ in range(max(0, need))]
        req.blocks += new
        return new

    def step(self):
        new_reqs, cached, num_sched, budget = [], CachedRequestData([], [], []), {}, self.budget
        for req in list(self.requests):
            if req.status == "WAITING_FOR_REMOTE_KVS":
                continue
            if not req.seen:
                req.seen = True
                ext, is_async = self.sched.get_num_new_matched_tokens(req, 0)
                if is_async and ext:
                    self._alloc(req, ext)
                    self.sched.update_state_after_alloc(req, KVCacheBlocks(req.blocks), ext)
                    req.status, req.loaded_tokens = "WAITING_FOR_REMOTE_KVS", ext
                    continue
            if budget == 0:
                break
            left = req.num_tokens - req.num_computed_tokens
            n = min(left, budget)
            fresh = req.status == "WAITING"
            new = self._alloc(req, req.num_computed_tokens + n)
            if fresh:
                if not req.loaded_tokens:
                    self.sched.update_state_after_alloc(req, KVCacheBlocks(req.blocks), 0)
                new_reqs.append(NewRequestData(req.request_id, req.prompt_token_ids, (list(req.blocks),),
                                               req.num_computed_tokens))
                req.status = "RUNNING"
            else:
                cached.req_ids.append(req.request_id)
                cached.new_block_ids.append((new,) if new else None)
                cached.num_computed_tokens.append(req.num_computed_tokens)
            num_sched[req.request_id] = n
            budget -= n
        out = SchedulerOutput(new_reqs, cached, num_sched, sum(num_sched.values()), set(self.finished_ids))
        self.finished_ids = set()
        out.kv_connector_metadata = self.sched.build_connector_meta(out)
        # --- the model runner -------------------------------------------------------
        self.worker.bind_connector_metadata(out.kv_connector_metadata)
        self.worker.start_load_kv(None)
        by_id = {r.request_id: r for r in self.requests}
        for li, (name, cache) in enumerate(self.kv_caches.items()):
            self.worker.wait_for_layer_load(name)
            for rid, n in num_sched.items():
                req = by_id[rid]
                tokens = req.prompt_token_ids + req.output_token_ids
                for pos in range(req.num_computed_tokens, req.num_computed_tokens + n):
                    kv = token_kv(self.seed, req.prompt_token_ids, pos, li, self.heads, self.head_dim, self.dtype)
                    cache[:, req.blocks[pos // self.bs], pos % self.bs] = kv
                del tokens
            self.worker.save_kv_layer(name, cache, None)
        self.worker.wait_for_save()
        sending, recving = self.worker.get_finished(out.finished_req_ids)
        invalid = self.worker.get_block_ids_with_load_errors()
        self.worker.clear_connector_metadata()
        self.sched.update_connector_output(KVConnectorOutput(sending, recving, invalid))
        # --- the scheduler's update ---------------------------------------------------
        for req in list(self.requests):
            if req.status == "WAITING_FOR_REMOTE_KVS" and recving and req.request_id in recving:
                failed = invalid and set(req.blocks) & invalid
                req.num_computed_tokens = 0 if failed else min(req.loaded_tokens, req.num_tokens - 1)
                req.status = "WAITING"
            n = num_sched.get(req.request_id)
            if n is None:
                continue
            req.num_computed_tokens += n
            req.computed_here, req.steps = req.computed_here + n, req.steps + 1
            if req.num_computed_tokens >= req.num_tokens:
                req.output_token_ids.append(len(req.output_token_ids) + 1)
                if len(req.output_token_ids) >= req.max_tokens:
                    delay, req.out_params = self.sched.request_finished(req, list(req.blocks))
                    assert not delay, "this connector frees at once"
                    self.requests.remove(req)
                    self.finished.append(req)
                    self.finished_ids.add(req.request_id)

    def request_kv(self, req, upto):
        """[layers, upto, 2, heads, head_dim]: the cache's K/V of req's first upto tokens."""
        return torch.stack([torch.stack([c[:, req.blocks[p // self.bs], p % self.bs] for p in range(upto)])
                            for c in self.kv_caches.values()])


_MODULES = {"vllm.config": ("KVTransferConfig", "VllmConfig", "CacheConfig", "ParallelConfig"),
            "vllm.distributed.kv_transfer.kv_connector.v1.base": ("KVConnectorRole", "KVConnectorMetadata",
                                                                 "KVConnectorBase_V1"),
            "vllm.distributed.kv_transfer.kv_connector.v1": ("KVConnectorRole", "KVConnectorBase_V1"),
            "vllm.distributed.kv_transfer.kv_connector.factory": ("KVConnectorFactory",),
            "vllm.v1.outputs": ("KVConnectorOutput",),
            "vllm.v1.core.sched.output": ("SchedulerOutput", "NewRequestData", "CachedRequestData")}


def install():
    """Put the stand-in's modules in sys.modules (only where vLLM is absent).
    Only these dotted names go in, never a bare `vllm`, so tests/fake_vllm.py's
    install() (which refuses where `import vllm` works) can still run after it."""
    real = sys.modules.get("vllm")
    if real is not None and getattr(real, "__file__", None) or real is None and \
            importlib.util.find_spec("vllm") is not None:
        raise RuntimeError("vLLM is installed: test against it, not the stand-in")
    me = sys.modules[__name__]
    for name, attrs in _MODULES.items():
        mod = sys.modules.get(name)
        if mod is None or getattr(mod, "__pz_kv_stand_in__", False) is False and not hasattr(mod, "__file__"):
            mod = sys.modules[name] = types.ModuleType(name)
            mod.__pz_kv_stand_in__ = True
        for a in attrs:
            setattr(mod, a, getattr(me, a))
