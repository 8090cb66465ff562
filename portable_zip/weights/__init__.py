"""pz.weights: RL weight sync (a trainer's named tensors to inference
engines) over a pz.Communicator, in buckets, with exact delta coding against
the version each receiver holds and a full sync where it cannot (docs/WEIGHTS.md).
Adapters: portable_zip.weights.vllm (a vLLM weight-transfer engine) and
portable_zip.weights.verl (a verl checkpoint engine), both importable without
those packages."""
from .engine import Receiver, Sender

__all__ = ["Sender", "Receiver"]
