"""KV-cache transfer for prefill/decode disaggregated serving (docs/KV.md):
a prefill rank's KVSender moves a request's paged KV blocks, layer by layer,
to the decode rank chosen for it, whose KVReceiver writes them into its own
blocks; over a pz.Communicator, which picks raw or compressed per transfer.
portable_zip.kv.vllm is a vLLM KV connector on it."""
from .errors import KVIntegrityError, KVMismatchError, KVTransferError
from .layout import KVLayer
from .receiver import KVReceiver, RecvHandle
from .sender import KVSender, SendHandle

__all__ = ["KVIntegrityError", "KVLayer", "KVMismatchError", "KVReceiver", "KVSender", "KVTransferError",
           "RecvHandle", "SendHandle"]
