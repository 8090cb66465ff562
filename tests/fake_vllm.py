"""A faithful stand-in for the parts of vLLM (0.32/0.34 worker API) that a
weight-transfer engine touches, installed as `vllm.*` modules where vLLM is
absent (it has no CPU wheel; see docs/WEIGHTS.md). What it mimics, from
vllm/distributed/weight_transfer/{base,factory}.py, vllm/v1/worker/gpu_worker.py
and vllm/model_executor/model_loader/reload.py:
- WeightTransferEngine: __init__(config, vllm_config, device, model) setting
  config, vllm_config, parallel_config, model_config, device, model;
  parse_init_info / parse_update_info (cls(**d), TypeError -> ValueError);
  update_weights(dict) = receive_weights(parse_update_info(d));
- WeightTransferEngineFactory: register_engine(name, cls | "mod", "Cls")
  raising ValueError on a registered name; create_engine(config, ...) by
  config.backend, ValueError for an unknown one;
- Worker: the RPCs in order (init, then start -> update* -> finish, raising
  when misordered), the engine built at load_model;
- reload: start_reload(model) / finish_reload(model, model_config, device);
- a model whose load_weights(iterable of (name, tensor)) records each call."""
import abc
import dataclasses
import importlib
import sys
import types


@dataclasses.dataclass
class WeightTransferInitInfo(abc.ABC):  # noqa: B024 - an empty ABC dataclass, as in vLLM
    pass


@dataclasses.dataclass
class WeightTransferUpdateInfo(abc.ABC):  # noqa: B024
    pass


class WeightTransferEngine(abc.ABC):
    init_info_cls = WeightTransferInitInfo
    update_info_cls = WeightTransferUpdateInfo
    supports_draft_weight_update = True
    defers_processing = False

    def __init__(self, config, vllm_config, device, model):
        self.config, self.vllm_config = config, vllm_config
        self.parallel_config, self.model_config = vllm_config.parallel_config, vllm_config.model_config
        self.device, self.model = device, model

    def parse_init_info(self, d):
        try:
            return self.init_info_cls(**d)
        except TypeError as e:
            raise ValueError(f"Invalid init_info: {e}") from e

    def parse_update_info(self, d):
        try:
            return self.update_info_cls(**d)
        except TypeError as e:
            raise ValueError(f"Invalid update_info: {e}") from e

    @abc.abstractmethod
    def init_transfer_engine(self, init_info): ...

    @abc.abstractmethod
    def start_weight_update(self): ...

    @abc.abstractmethod
    def finish_weight_update(self): ...

    def update_weights(self, update_info: dict) -> None:
        self.receive_weights(self.parse_update_info(update_info))

    @abc.abstractmethod
    def receive_weights(self, update_info): ...

    @abc.abstractmethod
    def shutdown(self): ...


class WeightTransferEngineFactory:
    _registry: dict = {}

    @classmethod
    def register_engine(cls, name, module_path_or_cls, class_name=None):
        if name in cls._registry:
            raise ValueError(f"Weight transfer engine '{name}' is already registered.")
        cls._registry[name] = (module_path_or_cls, class_name)

    @classmethod
    def create_engine(cls, config, vllm_config, device, model):
        if config.backend not in cls._registry:
            raise ValueError(f"Invalid weight transfer backend: {config.backend}")
        target, class_name = cls._registry[config.backend]
        if isinstance(target, str):
            target = getattr(importlib.import_module(target), class_name)
        return target(config, vllm_config, device, model)


RELOADS = []


def start_reload(model):
    RELOADS.append("start")


def finish_reload(model, model_config, device):
    RELOADS.append("finish")


class Model:
    def __init__(self):
        self.weights, self.calls = {}, []

    def load_weights(self, weights):
        names = set()
        batch = list(weights)
        self.calls.append([n for n, _ in batch])
        for n, t in batch:
            self.weights[n] = t.clone()  # vLLM copies into its own parameters
            names.add(n)
        return names


class Worker:
    """The worker's weight-transfer RPCs (v1/worker/gpu_worker.py)."""

    def __init__(self, backend, rank, world_size, device="cpu"):
        pc = types.SimpleNamespace(rank=rank, world_size=world_size, data_parallel_rank=0)
        self.vllm_config = types.SimpleNamespace(parallel_config=pc, model_config=types.SimpleNamespace(),
                                                 weight_transfer_config=types.SimpleNamespace(backend=backend))
        self.model = Model()
        self.engine = WeightTransferEngineFactory.create_engine(self.vllm_config.weight_transfer_config,
                                                                self.vllm_config, device, self.model)
        self.active = False

    def init_weight_transfer_engine(self, init_info: dict):
        self.engine.init_transfer_engine(self.engine.parse_init_info(init_info))

    def start_weight_update(self):
        if self.active:
            raise RuntimeError("a weight update is already active")
        self.active = True
        self.engine.start_weight_update()

    def update_weights(self, update_info):
        if not self.active:
            raise RuntimeError("update_weights before start_weight_update")
        self.engine.update_weights(update_info)

    def finish_weight_update(self):
        if not self.active:
            raise RuntimeError("finish_weight_update without a started update")
        self.engine.finish_weight_update()
        self.active = False

    def shutdown_weight_transfer_engine(self):
        self.engine.shutdown()


def install():
    """Put the stand-in in sys.modules as vllm.* (only where vLLM is absent)."""
    try:
        import vllm  # noqa: F401
        raise RuntimeError("vLLM is installed: test against it, not the stand-in")
    except ImportError:
        pass
    me = sys.modules[__name__]
    for name in ("vllm", "vllm.distributed", "vllm.distributed.weight_transfer", "vllm.model_executor",
                 "vllm.model_executor.model_loader"):
        sys.modules.setdefault(name, types.ModuleType(name))
    for name in ("vllm.distributed.weight_transfer.base", "vllm.distributed.weight_transfer.factory",
                 "vllm.model_executor.model_loader.reload"):
        sys.modules[name] = me
