"""The pz backend's options: init_process_group(..., pg_options=Options(...))
or new_group(..., pg_options=...). Anything left None comes from the
documented PZ_* variables (docs/SETTINGS.md), as for pz.Communicator."""
from __future__ import annotations

import datetime
import math
import numbers
from dataclasses import dataclass
from typing import Optional

from ..comm import check_args, overrides


@dataclass
class Options:
    """compress: "auto" (the cost model decides per op; never slower than the
        inner backend by its margin), "always" or "never" (same bytes, no coding).
    transport: "auto" (the inner backend: NCCL/RCCL for GPU tensors, gloo for
        CPU ones), "torch", or "fabric" (the libfabric engine between every
        pair; two ranks sharing one GPU need it, NCCL refuses them).
    domains: None, "host" or rank lists: native inside a domain, fabric between.
    timeout: seconds an op may take (default: PZ_TIMEOUT, else the group's
        torch timeout). max_sms: the most SMs a codec launch uses.
    link_gbps, latency_us, codec_gbps, margin: policy overrides."""
    compress: str = "auto"
    transport: str = "auto"
    domains: object = None
    timeout: Optional[float] = None
    max_sms: Optional[int] = None
    link_gbps: Optional[float] = None
    latency_us: Optional[float] = None
    codec_gbps: Optional[float] = None
    margin: Optional[float] = None

    @property
    def _timeout(self) -> Optional[datetime.timedelta]:
        """torch's name: DeviceMesh reads it from a backend_override's options."""
        return None if self.timeout is None else datetime.timedelta(seconds=self.timeout)

    def __post_init__(self):
        """Bad options raise where the group is made, not at its first op."""
        check_args(self.compress, self.transport, self.max_sms, "Options.")
        if self.domains is not None and isinstance(self.domains, str) and self.domains != "host":
            raise ValueError(f"Options.domains must be None, 'host' or a list of rank lists, got {self.domains!r}")
        t = self.timeout
        if t is not None and (isinstance(t, bool) or not isinstance(t, numbers.Real) or not 0 < t < math.inf):
            raise ValueError(f"Options.timeout must be None or a positive, finite number of seconds, got {t!r}")
        overrides(*((getattr(self, f), f"Options.{f}", None) for f in ("link_gbps", "latency_us", "codec_gbps",
                                                                        "margin")))

    def communicator_args(self) -> dict:
        return {"compress": self.compress, "transport": self.transport, "domains": self.domains,
                "max_sms": self.max_sms, "link_gbps": self.link_gbps, "latency_us": self.latency_us,
                "codec_gbps": self.codec_gbps, "margin": self.margin}
