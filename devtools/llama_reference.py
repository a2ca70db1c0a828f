"""A Llama forward pass in numpy float32, the computation `transformers` and vLLM run: what
devtools/tiny_model.py checks its programmed answer with before it publishes a model, without
torch on the control node."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

Array = npt.NDArray[np.float32]


def _rms_norm(x: Array, weight: Array, eps: float) -> Array:
    var = np.mean(x * x, axis=-1, keepdims=True)
    out: Array = (x / np.sqrt(var + np.float32(eps))) * weight
    return out


def _rope(x: Array, theta: float) -> Array:
    """Rotary embedding in the half-split layout of HF Llama checkpoints (x: [T, heads, d])."""
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
    angles = np.arange(x.shape[0], dtype=np.float64)[:, None] * inv_freq[None, :]
    cos = np.cos(np.concatenate([angles, angles], axis=-1)).astype(np.float32)[:, None, :]
    sin = np.sin(np.concatenate([angles, angles], axis=-1)).astype(np.float32)[:, None, :]
    half = d // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    out: Array = x * cos + rotated * sin
    return out


def reference_logits(w: Mapping[str, Array], config: Mapping[str, Any],
                     ids: Sequence[int]) -> Array:
    """The logits [len(ids), vocab] of a Llama forward pass over `ids`, in numpy float32: the
    same computation `transformers` and vLLM run, small enough to check the answer without
    torch."""
    heads = int(config["num_attention_heads"])
    kv_heads = int(config["num_key_value_heads"])
    d = int(config["head_dim"])
    eps = float(config["rms_norm_eps"])
    theta = float(config["rope_parameters"]["rope_theta"])
    t = len(ids)
    x: Array = w["model.embed_tokens.weight"][np.asarray(ids)]
    causal = np.triu(np.full((t, t), -np.inf, dtype=np.float32), k=1)
    for i in range(int(config["num_hidden_layers"])):
        p = f"model.layers.{i}."
        h = _rms_norm(x, w[p + "input_layernorm.weight"], eps)
        q = _rope((h @ w[p + "self_attn.q_proj.weight"].T).reshape(t, heads, d), theta)
        k = _rope((h @ w[p + "self_attn.k_proj.weight"].T).reshape(t, kv_heads, d), theta)
        v = (h @ w[p + "self_attn.v_proj.weight"].T).reshape(t, kv_heads, d)
        k = np.repeat(k, heads // kv_heads, axis=1)
        v = np.repeat(v, heads // kv_heads, axis=1)
        scores = np.einsum("qhd,khd->hqk", q, k) / np.float32(np.sqrt(d)) + causal
        scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
        probs = scores / scores.sum(axis=-1, keepdims=True)
        attn = np.einsum("hqk,khd->qhd", probs, v).reshape(t, heads * d)
        x = x + attn @ w[p + "self_attn.o_proj.weight"].T
        h = _rms_norm(x, w[p + "post_attention_layernorm.weight"], eps)
        gate = h @ w[p + "mlp.gate_proj.weight"].T
        up = h @ w[p + "mlp.up_proj.weight"].T
        x = x + ((gate / (1.0 + np.exp(-gate))) * up) @ w[p + "mlp.down_proj.weight"].T
    logits: Array = _rms_norm(x, w["model.norm.weight"], eps) @ w["lm_head.weight"].T
    return logits.astype(np.float32)


def reference_generate(w: Mapping[str, Array], config: Mapping[str, Any], ids: Sequence[int],
                       max_tokens: int) -> tuple[list[int], float]:
    """Greedy decoding, stopping after EOS: the generated ids and the smallest gap between the
    top logit and the runner-up over all steps."""
    seq = list(ids)
    out: list[int] = []
    margin = float("inf")
    for _ in range(max_tokens):
        last = reference_logits(w, config, seq)[-1]
        top2 = np.sort(last)[-2:]
        margin = min(margin, float(top2[1] - top2[0]))
        nxt = int(np.argmax(last))
        out.append(nxt)
        seq.append(nxt)
        if nxt == int(config["eos_token_id"]):
            break
    return out, margin


__all__ = ["Array", "reference_generate", "reference_logits"]
