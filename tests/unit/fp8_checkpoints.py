"""FP8 checkpoints in the layout Hugging Face releases ship, written from a float checkpoint, with their twin: the
same checkpoint holding the dequantized weights in float32.

The quantization here is written independently of the engine's (quantization.py): absmax over each output row, or
over each block of rows and columns, divided to land on 448, rounded by torch's cast.
- per channel: `X.weight` float8_e4m3fn [N, K] and `X.weight_scale` float32 [N, 1] (or one value per tensor);
- blocks (Qwen3-FP8, DeepSeek-V3): `X.weight_scale_inv` [ceil(N / bn), ceil(K / bk)], bf16 or float32, with
  `weight_block_size` [bn, bk] in the quantization_config;
and config.json gains `quantization_config` with quant_method "fp8", dynamic activations, fmt e4m3, and the lm_head
in `modules_to_not_convert` as the releases list it. The twin's weight is q.float() * scale, expanded over each
block, computed in float32 (what a bf16 engine would get from dequantizing the release).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

# Checkpoint names of the projections FP8 covers, by their last component before ".weight".
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "attn_out", "ff_proj", "up_proj", "ff_out", "gate_proj",
               "down_proj", "query_key_value", "dense")  # the last two: LLaDA2's fused qkv and its o_proj
FP8_MAX = 448.0


def is_projection(name: str) -> bool:
    """A projection of a decoder layer (LLaDA's ff_out inside a block is its down projection; the top-level
    model.transformer.ff_out is its LM head, left in float as the releases leave lm_head)."""
    parts = name.split(".")
    return len(parts) >= 2 and parts[-1] == "weight" and parts[-2] in PROJECTIONS and (
        "layers" in parts or "blocks" in parts)


def quantize_blocks(weight: torch.Tensor, block: tuple[int, int] | None, per_tensor: bool = False):
    """weight [N, K] -> (q float8_e4m3fn, scale): [N, 1] per channel, [] per tensor, or [ceil(N/bn), ceil(K/bk)]."""
    w = weight.float()
    n, k = w.shape
    if block is None:
        amax = w.abs().amax() if per_tensor else w.abs().amax(1, keepdim=True)
        scale = amax / FP8_MAX
        return (w / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale
    bn, bk = block
    rows, cols = -(-n // bn), -(-k // bk)
    scale = torch.empty(rows, cols)
    q = torch.empty(n, k, dtype=torch.float8_e4m3fn)
    for i in range(rows):
        for j in range(cols):
            tile = w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk]
            scale[i, j] = tile.abs().amax() / FP8_MAX
            q[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] = (tile / scale[i, j]).clamp(-FP8_MAX, FP8_MAX).to(
                torch.float8_e4m3fn)
    return q, scale


def dequantize_blocks(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None) -> torch.Tensor:
    n, k = q.shape
    s = scale.float()
    if block is not None:
        s = s.repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]
    return q.float() * s


def write_fp8_pair(source: Path, fp8_dir: Path, float_dir: Path, block: tuple[int, int] | None = None,
                   scale_dtype: torch.dtype = torch.float32, per_tensor: bool = False) -> None:
    """From the float checkpoint `source` (one model.safetensors), the FP8 release in `fp8_dir` and its
    dequantized twin in `float_dir`."""
    for directory in (fp8_dir, float_dir):
        shutil.copytree(source, directory)
    with safe_open(source / "model.safetensors", framework="pt") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    fp8, dequantized = {}, {}
    for name, tensor in tensors.items():
        if not is_projection(name):
            fp8[name] = dequantized[name] = tensor
            continue
        q, scale = quantize_blocks(tensor, block, per_tensor)
        scale = scale.to(scale_dtype)
        fp8[name] = q
        fp8[name.removesuffix("weight") + ("weight_scale_inv" if block else "weight_scale")] = scale
        dequantized[name] = dequantize_blocks(q, scale, block)
    save_file(fp8, fp8_dir / "model.safetensors", metadata={"format": "pt"})
    save_file(dequantized, float_dir / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((fp8_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                     "modules_to_not_convert": ["lm_head"],
                                     **({"weight_block_size": list(block)} if block else {})}
    (fp8_dir / "config.json").write_text(json.dumps(config, indent=2))
