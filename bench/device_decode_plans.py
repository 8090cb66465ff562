"""The device-parsed decode (pz.decompress(buf, out=)) against the host-parsed
one on streams of each plan the encoder writes for one 2^27-symbol bf16
tensor: rANS (64 lanes, 2^15-symbol blocks) and the fixed code (32 lanes,
2^14): host wall time of the call plus pz.check, best of 5. A stream whose
block count the device decode did not expect used to run on one CTA.
    python -P bench/device_decode_plans.py
"""
import torch, time, portable_zip as pz
t = (torch.randn(1 << 27, device="cuda") * 0.02).bfloat16()
for codec in ("rans", "fixed"):
    b = pz.compress(t, codec=codec)
    out = torch.empty_like(t)
    for api in ("host-parsed", "out="):
        ts = []
        for _ in range(5):
            torch.cuda.synchronize(); s = time.perf_counter()
            if api == "out=":
                pz.decompress(b, out=out); pz.check()
            else:
                pz.decompress(b)
            torch.cuda.synchronize(); ts.append(time.perf_counter() - s)
        print(codec, api, pz.inspect(b)["lanes"], pz.inspect(b)["block_symbols"], f"{min(ts)*1e3:.2f} ms")
