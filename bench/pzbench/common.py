"""Benchmark helpers: timing, machine metadata, tables and result files;
the CPU codec rows and their table-cost estimate."""
from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from typing import Callable, Optional

import numpy as np
import torch

import portable_zip as pz
from harness.tensors import BAR, TENSORS, exponent_entropy_bound, make_tensor, symbols
from portable_zip.codec import reference as ref

from . import real_weights


def parse_size(s: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    s = s.strip().upper().removesuffix("IB").removesuffix("B")
    return int(float(s[:-1]) * units[s[-1]]) if s[-1] in units else int(s)


def fmt_size(n: int) -> str:
    for unit, k in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= k:
            return f"{n / k:g} {unit}"
    return f"{n} B"


def median_time(fn: Callable[[int], None], device: str, reps: int, warmup: int = 3, sleep_cycles: int = 0) -> float:
    """Median seconds of fn(rep), timed with device events on GPU (after warm-up).
    sleep_cycles > 0 queues a busy-wait kernel before each GPU rep, so the host
    enqueues the rep meanwhile and its call overhead is not timed."""
    for i in range(warmup):
        fn(i)
    times = []
    if device == "cuda":
        torch.cuda.synchronize()
        for i in range(reps):
            if sleep_cycles:
                torch.cuda._sleep(sleep_cycles)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn(i)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
    else:
        for i in range(reps):
            t0 = time.perf_counter()
            fn(i)
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def machine_info() -> dict:
    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "commit": os.environ.get("PZ_COMMIT") or _git_commit(),
        "portable_zip": pz.__version__,
        "backend": pz.backend_info(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_threads": torch.get_num_threads(),
    }
    info["backend"]["archs"] = ",".join(info["backend"]["archs"])
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        info["cuda"] = torch.version.cuda
        info["driver"] = _nvidia_smi("driver_version")
    return info


def _git_commit() -> Optional[str]:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=os.path.dirname(__file__)).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def _nvidia_smi(field: str) -> Optional[str]:
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader"],
                             capture_output=True, text=True, check=True).stdout
        return out.strip().splitlines()[0]
    except (OSError, subprocess.CalledProcessError, IndexError):
        return None


def bench_tensor(name: str, nbytes: int, rng: np.random.Generator, device: str = "cpu", copy: int = 0) -> torch.Tensor:
    """A synthetic tensor (harness.tensors) or a real weight set, tiled (real_weights; copies start at different elements)."""
    if name in real_weights.REAL:
        return real_weights.tiled(name, nbytes, device, copy)
    return make_tensor(name, nbytes, rng, device)


def codec_rows(device: str, nbytes: int, reps: int, names=None, seed=None) -> list:
    """Ratio next to its bound, and compress/decompress GB/s of input bytes."""
    rng = np.random.default_rng(seed)
    rows = []
    l2 = torch.cuda.get_device_properties(0).L2_cache_size if device == "cuda" else 0
    for name in names or TENSORS:
        # Rotate among distinct inputs whose total exceeds 3x L2 so no rep hits cache.
        copies = max(1, -(-3 * l2 // nbytes)) if device == "cuda" else 1
        inputs = [bench_tensor(name, nbytes, rng, device, i) for i in range(copies)]
        bufs = [pz.compress(t) for t in inputs]
        for t, b in zip(inputs, bufs):
            assert torch.equal(pz.decompress(b).view(torch.uint8), t.view(torch.uint8)), name
        ratio = pz.inspect(bufs[0])["ratio"]
        outs = [torch.empty_like(t) for t in inputs]
        tc = median_time(lambda i: pz.compress(inputs[i % copies], trim=False), device, reps)
        if device == "cuda":
            heads = [_decoder_launch(b, o) for b, o in zip(bufs, outs)]
            td = median_time(lambda i: heads[i % copies](), device, reps)
        else:
            td = median_time(lambda i: pz.decompress(bufs[i % copies], out=outs[i % copies]), device, reps)
        info = pz.inspect(bufs[0])
        lg = int(info["block_symbols"]).bit_length() - 1 if info["block_symbols"] else 12
        tables = table_cost(inputs[0], lg)
        rows.append({
            "tensor": name, "dtype": str(inputs[0].dtype).replace("torch.", ""), "bytes": nbytes,
            "device": device, "ratio": ratio, "bound": exponent_entropy_bound(inputs[0]),
            "bar": BAR.get(name, real_weights.BAR if name in real_weights.REAL else None),
            "est_local_tables": tables["local_tables"], "est_global_table": tables["global_table"],
            "compress_GBps": nbytes / tc / 1e9, "decompress_GBps": nbytes / td / 1e9,
            "compress_us": tc * 1e6, "decompress_us": td * 1e6, "reps": reps,
        })
    return rows


def table_cost(t: torch.Tensor, block_log2: int) -> dict:
    """Ratio cost of block-local frequency tables against one global table.

    Both sides are estimated with the same model (ideal rANS cost of each
    symbol under the quantized 12-bit frequencies, plus per-block states, word
    count, mode byte and padding), so the difference is the tables' own cost
    and benefit: local tables pay ~40-70 B per block but fit each block's
    statistics; a global table is paid once but fits no block exactly.
    """
    sym, raw_bits = symbols(t)
    sym = sym.astype(np.int64)
    n = sym.size
    nbytes = t.numel() * t.element_size()
    bs = 1 << block_log2
    nblocks = -(-n // bs)
    raw_bytes = n * raw_bits // 8
    per_block = 1 + 3 + 4 + 4 * ref.LANES + 8 + 8  # mode, table padding (avg), W, states, offset, padding (avg)

    def coded_bits(counts, freq):
        f = np.asarray(freq, np.float64)
        used = counts > 0
        return float(-(counts[used] * np.log2(f[used] / ref.PROB_SCALE)).sum())

    counts = [np.bincount(sym[b * bs:(b + 1) * bs], minlength=256) for b in range(nblocks)]
    glob = np.sum(counts, axis=0)
    gfreq = ref.quantize(glob, n)
    local = glob_cost = 0.0
    for c in counts:
        lf = ref.quantize(c, int(c.sum()))
        local += coded_bits(c, lf) / 8 + len(ref.table_bytes(lf)) + per_block
        glob_cost += coded_bits(c, gfreq) / 8 + per_block
    glob_cost += len(ref.table_bytes(gfreq))
    return {"local_tables": (raw_bytes + local) / nbytes, "global_table": (raw_bytes + glob_cost) / nbytes}


def _decoder_launch(buf, out):
    """The decode launch of decompress(), with the header already parsed and the
    error flag left on the device: times the kernel, not the header read-back."""
    from portable_zip import _C
    from portable_zip.codec import streams as codec

    head, _ = codec._header(buf)
    err = torch.zeros(1, dtype=torch.int32, device=buf.device)
    return lambda: _C.decompress_gpu(head, buf.data_ptr(), buf.numel(), out.data_ptr(), err.data_ptr(),
                                     codec._stream())


def print_table(rows: list, columns: list, title: str) -> None:
    try:
        from rich.console import Console
        from rich.table import Table

        table = Table(title=title)
        for c in columns:
            table.add_column(c)
        for r in rows:
            table.add_row(*[_cell(r[c]) for c in columns])
        Console(width=160).print(table)
    except ImportError:
        print(title)
        print(" | ".join(columns))
        for r in rows:
            print(" | ".join(_cell(r[c]) for c in columns))


def _cell(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def report(result: dict, path: Optional[str]) -> None:
    """Print one benchmark's result and, with a path, save it beside the machine's details."""
    print(json.dumps(result, indent=1, default=str))
    if path:
        with open(path, "w") as f:
            json.dump({"machine": machine_info(), "result": result}, f, indent=1, default=str)


def write_json(path: str, rows: list, extra: Optional[dict] = None) -> None:
    doc = {"machine": machine_info(), "rows": rows}
    if extra:
        doc.update(extra)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(doc, f, indent=1, default=str)
        f.write("\n")
