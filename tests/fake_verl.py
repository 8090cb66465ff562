"""A faithful stand-in for verl's checkpoint-engine protocol (verl 0.9.1,
verl/checkpoint_engine/base.py and the CheckpointEngineManager's order),
installed as verl.checkpoint_engine.base where verl is absent (its import
pulls ray, fastapi and torch pins; see docs/WEIGHTS.md). It mimics:
- CheckpointEngineRegistry: register(name) as a decorator that overwrites,
  get(name) raising ValueError listing the names, new(name, *a, **kw);
- CheckpointEngine: the abstract sync prepare / classmethod build_topology /
  init_process_group / finalize, async send_weights(weights, global_steps),
  and receive_weights(global_steps) called WITHOUT await and iterated as an
  async iterator (ensure_async_iterator);
- the manager's step: prepare on every worker (actor results first),
  build_topology, init_process_group(**kwargs[i]) everywhere, then send and
  receive concurrently, then finalize everywhere."""
import abc
import inspect
import sys
import types


class CheckpointEngine(abc.ABC):
    wire_format = "named_tensors"

    @abc.abstractmethod
    def prepare(self): ...

    @classmethod
    @abc.abstractmethod
    def build_topology(cls, actor_wg_world_size, rollout_world_size, metadata): ...

    @abc.abstractmethod
    def init_process_group(self, **kwargs): ...

    @abc.abstractmethod
    def finalize(self): ...

    @abc.abstractmethod
    async def send_weights(self, weights, global_steps=None): ...

    @abc.abstractmethod
    async def receive_weights(self, global_steps=None): ...


class CheckpointEngineRegistry:
    _registry: dict = {}

    def register(backend):  # a plain function used as a decorator, as in verl
        def wrap(cls):
            CheckpointEngineRegistry._registry[backend] = cls
            return cls
        return wrap

    @classmethod
    def get(cls, backend):
        if backend not in cls._registry:
            raise ValueError(f"Checkpoint engine {backend} not registered; registered: {sorted(cls._registry)}")
        return cls._registry[backend]

    @classmethod
    def new(cls, backend, *args, **kwargs):
        return cls.get(backend)(*args, **kwargs)


async def ensure_async_iterator(it):
    """verl's helper: iterate a sync or async iterable alike."""
    if hasattr(it, "__aiter__"):
        async for x in it:
            yield x
    else:
        assert not inspect.iscoroutine(it), "receive_weights must not be a coroutine"
        for x in it:
            yield x


def install():
    try:
        import verl  # noqa: F401
        raise RuntimeError("verl is installed: test against it, not the stand-in")
    except ImportError:
        pass
    for name in ("verl", "verl.checkpoint_engine"):
        sys.modules.setdefault(name, types.ModuleType(name))
    sys.modules["verl.checkpoint_engine.base"] = sys.modules[__name__]
