"""Tiny GGUF files: quantized blocks of each kind, and a small llama GGUF that transformers itself loads."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize


def _f16_bytes(a: np.ndarray) -> np.ndarray:
    return a.astype(np.float16).view(np.uint8).reshape(*a.shape[:-1], 2)


def blocks(rows: int, cols: int, kind: str, rng: np.random.Generator) -> np.ndarray:
    """Random GGUF blocks ``[rows, bytes]`` of ``kind``, with the edge cases every kind has to
    decode: all-zero and all-maximum quants, a negative and a subnormal scale, a zero scale."""
    nb = cols // 32
    d = rng.random((rows, nb, 1)) * 0.02 + 0.001
    d[0, 0], d[-1, -1], d[0, -1] = -0.013, 3e-6, 0.0  # 3e-6 is a float16 subnormal
    d16 = _f16_bytes(d)
    if kind == "Q8_0":
        q = rng.integers(-128, 128, (rows, nb, 32)).astype(np.int8)
        q[0, 0], q[-1, -1] = -128, 127
        return np.concatenate([d16, q.view(np.uint8)], -1).reshape(rows, -1)
    if kind == "Q4_K":  # fp16 d, fp16 dmin, 12 bytes of scales, 128 of nibbles per 256 weights
        raw = rng.integers(0, 256, (rows, cols // 256, 144)).astype(np.uint8)
        raw[..., 0:4] = _f16_bytes(np.full((rows, cols // 256, 2, 1), 0.01)).reshape(rows, cols // 256, 4)
        return raw.reshape(rows, -1)
    q = rng.integers(0, 256, (rows, nb, 16)).astype(np.uint8)
    q[0, 0], q[-1, -1] = 0x00, 0xFF
    if kind == "Q4_0":
        return np.concatenate([d16, q], -1).reshape(rows, -1)
    m = -rng.random((rows, nb, 1)) * 0.1
    m[1 % rows, 0] = 60000.0  # a large offset next to a small scale
    return np.concatenate([d16, _f16_bytes(m), q], -1).reshape(rows, -1)


def gguf_weight(raw: np.ndarray, kind: str) -> torch.Tensor:
    """What transformers loads for these blocks (it calls gguf's dequantize)."""
    return torch.from_numpy(np.ascontiguousarray(dequantize(raw, GGMLQuantizationType[kind])))



H, FF, NH, NKV, VOCAB = 64, 256, 4, 2, 96
KINDS = {"attn_q": "Q4_1", "attn_k": "Q4_0", "attn_v": "Q8_0", "attn_output": "Q4_1",
         "ffn_gate": "Q4_1", "ffn_up": "Q4_0", "ffn_down": "Q4_1"}


def write_tiny_gguf(path: Path, kinds: dict[str, str] = KINDS, layers: int = 2, seed: int = 0,
                    file_type: int | None = None, vocab: int = VOCAB, natural: bool = False) -> Path:
    """A llama GGUF of random blocks with the edge cases (a tied head), or with ``natural``: normal
    weights (std 0.02) quantized by gguf and an untied, sharpened Q8_0 head, whose greedy text
    varies (random blocks mostly repeat one token)."""
    rng = np.random.default_rng(seed)
    w = GGUFWriter(str(path), "llama")
    if file_type is not None:  # general.file_type, as llama.cpp's quantizer writes it
        w.add_file_type(file_type)
    w.add_block_count(layers)
    w.add_context_length(128)
    w.add_embedding_length(H)
    w.add_feed_forward_length(FF)
    w.add_head_count(NH)
    w.add_head_count_kv(NKV)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    w.add_rope_dimension_count(H // NH)
    shapes = {"attn_q": (H, H), "attn_k": (H // NH * NKV, H), "attn_v": (H // NH * NKV, H), "attn_output": (H, H),
              "ffn_gate": (FF, H), "ffn_up": (FF, H), "ffn_down": (H, FF)}

    def add(name: str, shape: tuple[int, int], kind: str, std: float = 0.02) -> None:
        if natural:
            from gguf.quants import quantize

            raw = quantize((rng.standard_normal(shape) * std).astype(np.float32), GGMLQuantizationType[kind])
        else:
            raw = blocks(*shape, kind, rng)
        w.add_tensor(name, raw, raw_dtype=GGMLQuantizationType[kind])

    add("token_embd.weight", (vocab, H), "Q8_0")  # without output.weight the head is tied to it
    if natural:
        add("output.weight", (vocab, H), "Q8_0", std=0.16)
    for i in range(layers):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(H, np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(H, np.float32))
        for part, shape in shapes.items():
            add(f"blk.{i}.{part}.weight", shape, kinds[part])
    w.add_tensor("output_norm.weight", np.ones(H, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def load_gguf(path: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()

