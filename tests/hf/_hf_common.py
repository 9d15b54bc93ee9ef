"""Shared helpers of the Hugging Face parity tests: tiny seeded transformers models saved to disk."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

torch.set_num_threads(1)


def rms_rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.sqrt(np.mean((a - b) ** 2)) / np.sqrt(np.mean(b ** 2)))


def perturb_(model, seed: int = 0):
    """Non-trivial values for the parameters transformers initialises to constants: norm weights
    (zero-centred ones to N(0, 0.3), gated norms to 1 + N(0, 0.3)), A_log in log U(0.5, 4), dt_bias
    N(0, 1), and the conv taps scaled up so that reversing them changes the output."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(0.5, 4.0, generator=g).log())
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn(p.shape, generator=g))
            elif name.endswith("norm.weight") and ("linear_attn.norm" in name or "o_norm" in name):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g))
            elif name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
            elif "conv1d" in name:
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
    return model


def qwen35_config(layer_types, *, Hk=2, Hv=2, tie=False, vocab=97):
    return transformers.Qwen3_5TextConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=len(layer_types),
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=Hk,
        linear_num_value_heads=Hv, linear_key_head_dim=8, linear_value_head_dim=8, layer_types=list(layer_types),
        tie_word_embeddings=tie, rms_norm_eps=1e-6)


def qwen3next_config(layer_types, *, Hk=2, Hv=2, vocab=97):
    return transformers.Qwen3NextConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=len(layer_types),
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=Hk,
        linear_num_value_heads=Hv, linear_key_head_dim=8, linear_value_head_dim=8, layer_types=list(layer_types),
        num_experts=0, tie_word_embeddings=False, rms_norm_eps=1e-6)


def build_hf(config, seed: int = 0):
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    return perturb_(model, seed)


def save_hf(model, path) -> str:
    model.save_pretrained(str(path))
    return str(path)


def hf_logits(model, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.as_tensor(ids), use_cache=False).logits.numpy()
