"""SDAR-MoE (JetLM/SDAR-30B-A3B-Chat): Qwen3-MoE weights trained block-causally for block diffusion.

SDAR's attention (Qwen3: per-head q/k norm, full rotary) and config keys, with Qwen3-MoE's MLP: a softmax router
over all experts, the top `num_experts_per_tok`, their weights renormalised when `norm_topk_prob`, and no shared
expert. Layers listed in `mlp_only_layers`, or off the `decoder_sparse_step` stride, keep a dense MLP.
"""
from __future__ import annotations

from diffulex_backend.arch import RouterScore
from diffulex_backend.models.decoder_lm import FusedPart
from diffulex_backend.models.hf_config import ConfigReader
from diffulex_backend.models.qwen import QwenModel
from diffulex_backend.models.sdar import SDARModel
from diffulex_backend.registry import AutoModelForDiffusionLM


@AutoModelForDiffusionLM.register("sdar_moe")
class SDARMoeModel(QwenModel):
    FAMILY = "sdar_moe"
    MODEL_TYPES = ("sdar_moe",)
    ARCHITECTURES = ("SDARMoeForCausalLM",)
    CONFIG_KEYS = SDARModel.CONFIG_KEYS | {
        "decoder_sparse_step", "mlp_only_layers", "moe_intermediate_size", "norm_topk_prob", "num_experts",
        "num_experts_per_tok", "output_router_logits", "router_aux_loss_coef",
    }
    QK_NORM = True
    LAYER_WEIGHTS = {**QwenModel.LAYER_WEIGHTS, "mlp.gate.weight": ("mlp.gate.weight", None)}
    EXPERT_WEIGHTS = {
        "mlp.experts.{}.gate_proj.weight": ("mlp.w_gate_up", FusedPart.GATE),
        "mlp.experts.{}.up_proj.weight": ("mlp.w_gate_up", FusedPart.UP),
        "mlp.experts.{}.down_proj.weight": ("mlp.w_down", None),
    }
    RANDOM_ARCH = dict(qk_norm=True, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32)

    @classmethod
    def moe_fields(cls, c: ConfigReader, num_layers: int) -> dict:
        step = c.int("decoder_sparse_step", 1)
        dense_only = c.config.get("mlp_only_layers") or []
        if not isinstance(dense_only, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in dense_only):
            raise ValueError(f"{c.path}: config key 'mlp_only_layers' must be a list of layer indices, got {dense_only!r}")
        return dict(
            num_experts=c.int("num_experts"),
            num_experts_per_tok=c.int("num_experts_per_tok"),
            moe_intermediate_size=c.int("moe_intermediate_size"),
            # Qwen3-MoE: a layer is sparse unless listed in mlp_only_layers or off the sparse step's stride.
            dense_layers=tuple(i for i in range(num_layers) if i in dense_only or (i + 1) % step),
            router_score=RouterScore.SOFTMAX,
            norm_topk_prob=c.bool("norm_topk_prob", False),
        )
