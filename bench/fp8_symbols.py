"""Why e5m2 uses the top four exponent bits as its code (docs/FORMAT.md).

For each candidate split of an fp8 pair into an 8-bit symbol + 8 raw bits,
prints the order-0 bound (symbol entropy + raw bits) / 16 on several
distributions. Run: python bench/fp8_symbols.py
"""
import numpy as np
import torch


def entropy(sym):
    p = np.bincount(sym, minlength=256) / sym.size
    p = p[p > 0]
    return float(-(p * np.log2(p)).sum())


def ratio(codes):
    # codes: per-element 4-bit codes; pairs form the symbol, 8 raw bits per pair.
    sym = (codes[0::2] | (codes[1::2] << 4)).astype(np.int64)
    return (entropy(sym) + 8) / 16


def main():
    rng = np.random.default_rng(0)
    n = 1 << 22
    dists = {
        "U[-1,1]": rng.uniform(-1, 1, n),
        "N(0,1)": rng.standard_normal(n),
        "N(0,1) scaled to max 57344": None,
        "N(0,1e-3) gradients": rng.standard_normal(n) * 1e-3,
    }
    g = rng.standard_normal(n)
    dists["N(0,1) scaled to max 57344"] = g / np.abs(g).max() * 57344
    print(f"{'distribution':32} {'top-4 code (chosen)':>20} {'low-4 code':>12} {'whole byte, 1 sym/elem':>24}")
    for name, v in dists.items():
        x = torch.from_numpy(v.astype(np.float32)).to(torch.float8_e5m2).view(torch.uint8).numpy()
        top = ratio((x >> 3) & 0xF)
        low = ratio((x >> 2) & 0xF)
        whole = entropy(x.astype(np.int64)) / 8
        print(f"{name:32} {top:20.4f} {low:12.4f} {whole:24.4f}")


if __name__ == "__main__":
    main()
