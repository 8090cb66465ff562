"""Digests of the streams one build writes on the GPU (or, --device cpu, on
the CPU), to compare two builds or two devices byte for byte (the prebuilt
wheel against a source build, or its GPU streams against its CPU codec's):

    python3 -P bench/stream_digest.py --out A.json         (with build A importable)
    python3 -P bench/stream_digest.py --out B.json         (with build B importable, or --device cpu)
    python3 -P bench/stream_digest.py --compare A.json B.json --json RESULT.json

Tensors come from a fixed seed: every dtype, sizes from 1 element to 64 MiB,
aligned and offset views, one batch. Each stream also round-trips bit-exact
and decodes on the CPU to the same bits."""
import argparse
import datetime
import hashlib
import json
import sys

import torch


def cases():
    g = torch.Generator(device="cpu").manual_seed(20261201)
    sizes = [1, 31, 4097, 65_537, 1 << 20, 3 * (1 << 20) + 5, 32 << 20]
    for dt in (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2, torch.int32,
               torch.bool):
        for n in sizes:
            if dt.is_floating_point:
                t = (torch.randn(n, generator=g) * 0.02).to(dt)
            elif dt == torch.bool:
                t = torch.rand(n, generator=g) < 0.3
            else:
                t = torch.randint(-1000, 1000, (n,), generator=g, dtype=dt)
            yield f"{dt}/{n}", t
    big = (torch.randn(16 << 20, generator=g) * 0.02).to(torch.bfloat16)
    yield "bf16/offset-view", big[3:]


def digest(out: str, device: str) -> None:
    import portable_zip as pz

    res = {}
    for name, t in cases():
        d = t.to(device)
        buf = pz.trim(pz.compress(d))
        back = pz.decompress(buf)
        assert torch.equal(back.cpu().view(torch.uint8), t.contiguous().view(torch.uint8)), name
        assert torch.equal(pz.decompress(buf.cpu()).view(torch.uint8), t.contiguous().view(torch.uint8)), name
        res[name] = hashlib.sha256(buf.cpu().numpy().tobytes()).hexdigest()
    batch = [(torch.randn(n, generator=torch.Generator().manual_seed(n)) * 0.02).to(torch.bfloat16)
             for n in (4096, 100_000, 1 << 20)]
    batch = [b.to(device) for b in batch]
    for i, b in enumerate(pz.compress_batch(batch, trim=True)):
        res[f"batch/{i}"] = hashlib.sha256(b.cpu().numpy().tobytes()).hexdigest()
    info = pz.backend_info()
    json.dump({"digests": res, "device": device, "backend": info, "module": pz.__file__}, open(out, "w"), indent=1)
    print(f"{len(res)} streams from {pz.__file__} on {device} ({info['backend']}, {info.get('device_image')})")


def compare(a: str, b: str, out: str) -> int:
    A, B = json.load(open(a)), json.load(open(b))
    differ = sorted(k for k in set(A["digests"]) | set(B["digests"]) if A["digests"].get(k) != B["digests"].get(k))
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    result = {"what": "streams of two builds or devices, byte for byte", "date": datetime.date.today().isoformat(),
              "gpu": gpu, "torch": torch.__version__, "command": " ".join(sys.argv),
              "builds": [{"file": f, "module": D["module"], "device": D.get("device", "cuda"), "backend": D["backend"]}
                         for f, D in ((a, A), (b, B))],
              "streams": len(A["digests"]), "identical": not differ, "differ": differ}
    json.dump(result, open(out, "w"), indent=1)
    print(f"{len(A['digests'])} streams: {'identical' if not differ else f'{len(differ)} differ: {differ[:5]}'}")
    return 1 if differ else 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--compare", nargs=2)
    ap.add_argument("--json", default="wheel-vs-source.json")
    a = ap.parse_args()
    if a.compare:
        sys.exit(compare(*a.compare, a.json))
    digest(a.out, a.device)
