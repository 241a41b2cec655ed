"""The table the patcher reads: one row per Hugging Face model family, naming its module classes and
the conventions that decide which kernelkit op replaces them. A new family is a new row here.

What each column drives (see `kernelkit.patch.patch`):
- `norms`: RMSNorm classes, run by `kernelkit.rms_norm` with `norm_offset` (1.0 is Gemma's ``(1 + w)``);
  classes the op registry lists in the rms_norm spec's `replaces` are patched too, with the row's offset.
- `mlps`: gated MLPs, run as ``down_proj(glu(gate_proj(x), up_proj(x)))`` (`mlp_layout="split"`) or
  ``down_proj(glu(gate_up_proj(x)))`` with the gate in the first half (`"fused"`, Phi-3); the glu is
  chosen by the class of the MLP's activation module (`ACTIVATIONS`), so one row serves every config.
- `attentions`: attention classes whose forward calls `rope_function` (Hugging Face's per-token
  cos/sin, computed by the model's own rotary module, so every rope scaling comes for free) and the
  attention interface (kernelkit's attention through `transformers.AttentionInterface`).
- `moe_blocks`: sparse MoE blocks whose forward routes with its own `gate` (a top-k router module) and
  calls ``self.experts(hidden_states, top_k_index, top_k_weights)``. The experts module (SiLU, weights
  `gate_up_proj` (E, 2I, H) gate rows first and `down_proj` (E, H, I)) runs `kernelkit.ops.moe.moe_experts`
  (grouped GEMMs); the block's forward, its router and the router logits it records are Hugging Face's.
- `router_aux_loss`: the causal LM adds ``router_aux_loss_coef * load_balancing_loss_func(...)`` to
  its loss when router logits are requested (Mixtral, Qwen3-MoE).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple[str, ...]  # config.model_type values
    norms: tuple[str, ...]
    norm_offset: float = 0.0
    mlps: tuple[str, ...] = ()
    mlp_layout: str = "split"  # "split": gate_proj + up_proj; "fused": gate_up_proj, gate first
    mlp_activation: str = "act_fn"  # attribute of the MLP holding its activation module
    attentions: tuple[str, ...] = ()
    rope_function: str = "apply_rotary_pos_emb"  # module-level function the attention forward calls
    moe_blocks: tuple[str, ...] = ()
    router_aux_loss: bool = False


FAMILIES: tuple[Family, ...] = (
    Family("llama", ("llama",), norms=("LlamaRMSNorm",), mlps=("LlamaMLP",), attentions=("LlamaAttention",)),
    Family("mistral", ("mistral",), norms=("MistralRMSNorm",), mlps=("MistralMLP",),
           attentions=("MistralAttention",)),
    Family("qwen2", ("qwen2",), norms=("Qwen2RMSNorm",), mlps=("Qwen2MLP",), attentions=("Qwen2Attention",)),
    # Qwen3's q_norm / k_norm are Qwen3RMSNorm over head_dim: the same row covers them.
    Family("qwen3", ("qwen3",), norms=("Qwen3RMSNorm",), mlps=("Qwen3MLP",), attentions=("Qwen3Attention",)),
    Family("gemma", ("gemma",), norms=("GemmaRMSNorm",), norm_offset=1.0, mlps=("GemmaMLP",),
           attentions=("GemmaAttention",)),
    Family("gemma2", ("gemma2",), norms=("Gemma2RMSNorm",), norm_offset=1.0, mlps=("Gemma2MLP",),
           attentions=("Gemma2Attention",)),
    Family("gemma3", ("gemma3_text", "gemma3"), norms=("Gemma3RMSNorm",), norm_offset=1.0, mlps=("Gemma3MLP",),
           attentions=("Gemma3Attention",)),
    Family("phi3", ("phi3",), norms=("Phi3RMSNorm",), mlps=("Phi3MLP",), mlp_layout="fused",
           mlp_activation="activation_fn", attentions=("Phi3Attention",)),
    Family("mixtral", ("mixtral",), norms=("MixtralRMSNorm",), attentions=("MixtralAttention",),
           moe_blocks=("MixtralSparseMoeBlock",), router_aux_loss=True),
    # Dense layers of Qwen3-MoE (mlp_only_layers) use Qwen3MoeMLP; the sparse layers Qwen3MoeSparseMoeBlock.
    Family("qwen3_moe", ("qwen3_moe",), norms=("Qwen3MoeRMSNorm",), mlps=("Qwen3MoeMLP",),
           attentions=("Qwen3MoeAttention",), moe_blocks=("Qwen3MoeSparseMoeBlock",),
           router_aux_loss=True),
)

# Class of an MLP's activation module -> (kernelkit glu, keyword arguments). Activations not listed
# (quick-gelu, relu², ...) leave the MLP unpatched, with the reason in the report.
ACTIVATIONS: dict[str, tuple[str, dict]] = {
    "SiLU": ("swiglu", {}),
    "SiLUActivation": ("swiglu", {}),
    "GELUTanh": ("geglu", {"approximate": "tanh"}),
    "PytorchGELUTanh": ("geglu", {"approximate": "tanh"}),
    "NewGELUActivation": ("geglu", {"approximate": "tanh"}),
    "GELUActivation": ("geglu", {"approximate": "none"}),
    "GELU": ("geglu", {"approximate": "none"}),  # torch.nn.GELU(); its `approximate` is read at patch time
}


def find_family(model) -> Family:
    """The row for `model`: by config.model_type, else by the module classes it holds."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    for fam in FAMILIES:
        if model_type in fam.model_types:
            return fam
    classes = {type(m).__name__ for m in model.modules()}
    for fam in FAMILIES:
        if classes & set(fam.norms + fam.mlps + fam.attentions + fam.moe_blocks):
            return fam
    raise ValueError(f"kernelkit.patch has no row for model_type {model_type!r} ({type(model).__name__}); "
                     f"known families: {', '.join(f.name for f in FAMILIES)}. Add a Family row to "
                     f"kernelkit.patch.families.FAMILIES.")
