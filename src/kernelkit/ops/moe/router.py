"""The MoE router in torch ops (Mixtral / Qwen3-MoE softmax, DeepSeek-V3 sigmoid with its bias and group-limited
top-k) and the load-balancing statistics, without a host sync.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from .. import _validate


def route(x: torch.Tensor, router_weight: torch.Tensor, top_k: int, scoring: str = "softmax",
          renormalize: bool = True, *, expert_bias: Optional[torch.Tensor] = None, n_group: int = 1,
          topk_group: Optional[int] = None, routed_scaling_factor: float = 1.0):
    """(weights (T, k) fp32, experts (T, k) int64) for x (T, H): the router in torch ops (one small GEMM, an
    elementwise map and a top-k), differentiable in x and router_weight through the weights.

    DeepSeek-V3's options: `expert_bias` (E,) is added to the probabilities for the choice only (the weights are
    the unbiased probabilities of the chosen experts: auxiliary-loss-free load balancing); with `n_group` > 1 the
    experts form n_group equal groups, each scored by the sum of its two best (biased) probabilities, and only the
    `topk_group` best groups compete for the top_k; the weights are multiplied by `routed_scaling_factor` after
    the renormalization."""
    logits = F.linear(x.float(), router_weight.float())
    probs = logits.softmax(-1) if scoring == "softmax" else logits.sigmoid()
    return _select(probs, top_k, renormalize, expert_bias, n_group, topk_group, routed_scaling_factor)


def _select(probs, top_k, renormalize, expert_bias=None, n_group=1, topk_group=None, routed_scaling_factor=1.0):
    """route's choice and weights from the router probabilities (T, E), in their dtype."""
    choice = probs.detach() if expert_bias is None else probs.detach() + expert_bias.detach().to(probs.dtype)
    if n_group > 1:
        t, n_exp = choice.shape
        groups = choice.view(t, n_group, n_exp // n_group)
        group_scores = groups.topk(min(2, n_exp // n_group), dim=-1).values.sum(-1)
        kept = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(
            1, group_scores.topk(topk_group, dim=-1).indices, True)
        choice = groups.masked_fill(~kept[:, :, None], -float("inf")).view(t, n_exp)
    experts = choice.topk(top_k, dim=-1).indices
    weights = probs.gather(1, experts)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    if routed_scaling_factor != 1.0:
        weights = weights * routed_scaling_factor
    return weights, experts


def expert_counts(experts: torch.Tensor, n_experts: int) -> torch.Tensor:
    """Tokens routed to each expert (int64 (E,)), for a load-balancing loss or monitoring: a scatter-add on the
    device, no host sync (torch.bincount reads the largest id on the host)."""
    flat = experts.reshape(-1)
    return torch.zeros(n_experts, dtype=torch.int64, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))


def load_balancing_loss(x: torch.Tensor, router_weight: torch.Tensor, experts: torch.Tensor,
                        scoring: str = "softmax") -> torch.Tensor:
    """Switch Transformer's auxiliary loss, E * sum_e f_e * P_e (f_e the fraction of routed (token, slot) pairs
    that chose expert e, P_e the mean router probability of e; sigmoid scores normalized per token first),
    differentiable in x and router_weight through P; 1.0 when routing and probabilities are even. No host sync."""
    logits = F.linear(x.reshape(-1, x.shape[-1]).float(), router_weight.float())
    probs = logits.softmax(-1) if scoring == "softmax" else logits.sigmoid()
    if scoring != "softmax":  # sigmoid scores as shares of each token's total (DeepSeek-V3's balance loss)
        probs = probs / probs.sum(-1, keepdim=True)
    n_exp = router_weight.shape[0]
    frac = expert_counts(experts, n_exp).float() / max(experts.numel(), 1)
    return n_exp * (frac * probs.mean(0)).sum()


def _check_routing(n_exp, top_k, expert_bias, n_group, topk_group, routed_scaling_factor, x=None) -> None:
    """Validate route's DeepSeek-V3 options."""
    if expert_bias is not None:
        if not isinstance(expert_bias, torch.Tensor) or expert_bias.shape != (n_exp,) or \
                not expert_bias.is_floating_point():
            raise ValueError(f"expert_bias must be a float tensor of shape ({n_exp},) (one per expert), got "
                             f"{tuple(expert_bias.shape) if isinstance(expert_bias, torch.Tensor) else expert_bias!r}")
        if x is not None:
            _validate.same_device(expert_bias, "expert_bias", x, "x")
    if isinstance(n_group, bool) or not isinstance(n_group, int) or n_group < 1 or n_exp % n_group:
        raise ValueError(f"n_group must be a positive int dividing the number of experts ({n_exp}), got {n_group!r}")
    if n_group > 1:
        if isinstance(topk_group, bool) or not isinstance(topk_group, int) or not 1 <= topk_group <= n_group:
            raise ValueError(f"topk_group must be an int between 1 and n_group ({n_group}) when n_group > 1, got "
                             f"{topk_group!r}")
        if top_k > topk_group * (n_exp // n_group):
            raise ValueError(f"top_k ({top_k}) is more experts than topk_group ({topk_group}) groups of "
                             f"{n_exp // n_group} hold")
    elif topk_group not in (None, 1):
        raise ValueError(f"topk_group ({topk_group}) needs n_group > 1")
    if isinstance(routed_scaling_factor, bool) or not isinstance(routed_scaling_factor, (int, float)):
        raise TypeError(f"routed_scaling_factor must be a number, got {type(routed_scaling_factor).__name__}")
    if not math.isfinite(routed_scaling_factor):
        raise ValueError(f"routed_scaling_factor must be finite, got {routed_scaling_factor!r}")
