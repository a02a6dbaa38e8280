"""``MoEConfig``: the normalized facts of a mixture-of-experts MLP, from any family's HF config.

One block (:class:`attnplug.runner.models.moe.MoEBlock`) runs every router and expert kind;
each family's config spells them differently, and :func:`parse_moe` reads them:

=================  ======================================  =====================================
model_type         router (``scoring_func``/``topk_method``)  experts
=================  ======================================  =====================================
``qwen3_moe``      softmax / greedy, ``norm_topk_prob``    SwiGLU, ``gate_up_proj [E, 2I, H]``
``deepseek_v2``    softmax / greedy or                     SwiGLU + ``n_shared_experts``
                   ``group_limited_greedy`` (group max);
                   ``norm_topk_prob`` refused (HF 5.24
                   ignores it, DeepSeek's code applies it)
``deepseek_v3``    sigmoid / ``noaux_tc`` (correction      SwiGLU + ``n_shared_experts``
                   bias, group top-2 sum, renorm, scale)
``gpt_oss``        router with bias / ``topk_softmax``     clamped SwiGLU (``swiglu_limit``,
                   (softmax over the k chosen logits)      ``alpha``), biases, gate/up interleaved
=================  ======================================  =====================================

Which layers are sparse: ``first_k_dense_replace`` (DeepSeek), ``mlp_only_layers`` and
``decoder_sparse_step`` (Qwen-MoE): :func:`sparse_layers`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from attnplug.runner.models.config import ModelConfigError, positive_int_problems

SCORING_FUNCS = ("softmax", "sigmoid")
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc", "topk_softmax")
EXPERT_KINDS = ("swiglu", "swiglu_clamp")


@dataclass(frozen=True)
class MoEConfig:
    """A mixture-of-experts MLP.

    Attributes:
        hidden_size: ``H``, the block's input and output width.
        num_experts: ``E`` routed experts (``num_experts`` / ``n_routed_experts`` /
            ``num_local_experts``).
        num_experts_per_tok: ``k`` experts per token.
        moe_intermediate_size: ``I``, each routed expert's intermediate width.
        scoring_func: ``softmax`` or ``sigmoid`` of the router logits.
        topk_method: ``greedy`` (top-k of the scores), ``group_limited_greedy`` (DeepSeek-V2:
            top ``topk_group`` of ``n_group`` groups by their best score, then top-k),
            ``noaux_tc`` (DeepSeek-V3: choose on ``score + e_score_correction_bias``, groups by
            the sum of their top-2, weights from the uncorrected scores), ``topk_softmax``
            (gpt-oss: top-k of the logits, softmax over those k).
        norm_topk_prob: divide the k weights by their sum (``noaux_tc`` adds 1e-20 to it).
        routed_scaling_factor: multiplies the k weights after renormalisation.
        n_group, topk_group: expert groups and how many of them a token may use.
        num_shared_experts: shared experts, one SwiGLU MLP of width ``I * num_shared_experts``
            applied to every token (``n_shared_experts``).
        expert_kind: ``swiglu`` (``down(silu(gate) * up)``) or ``swiglu_clamp`` (gpt-oss:
            ``gate <= limit``, ``|up| <= limit``, ``(up + 1) * gate * sigmoid(alpha * gate)``).
        swiglu_limit, swiglu_alpha: of ``swiglu_clamp``.
        expert_bias: the experts have ``gate_up_proj_bias`` / ``down_proj_bias`` (gpt-oss).
        router_bias: the router has a bias (gpt-oss).
        router_name: the router's HF module name (``gate``, or ``router`` for gpt-oss).
        router_fp32: router logits in float32 from a float32 weight (DeepSeek).
    """

    hidden_size: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    scoring_func: str = "softmax"
    topk_method: str = "greedy"
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    num_shared_experts: int = 0
    expert_kind: str = "swiglu"
    swiglu_limit: float = 7.0
    swiglu_alpha: float = 1.702
    expert_bias: bool = False
    router_bias: bool = False
    router_name: str = "gate"
    router_fp32: bool = False

    @property
    def shared_intermediate_size(self) -> int:
        """Width of the shared experts' MLP (``moe_intermediate_size * num_shared_experts``)."""
        return self.moe_intermediate_size * self.num_shared_experts

    def __post_init__(self):
        problem = self.first_problem()
        if problem:
            raise ModelConfigError(f"invalid mixture-of-experts config: {problem}. Fix the config.json values.")

    def first_problem(self) -> str | None:
        """The first inconsistency, naming its field, or ``None``."""
        sizes = positive_int_problems(self, ("hidden_size", "num_experts", "num_experts_per_tok",
                                             "moe_intermediate_size", "n_group", "topk_group"))
        if sizes:
            return sizes[0]
        if self.scoring_func not in SCORING_FUNCS:
            return f"scoring_func {self.scoring_func!r} is not implemented (implemented: {', '.join(SCORING_FUNCS)})"
        if self.topk_method not in TOPK_METHODS:
            return f"topk_method {self.topk_method!r} is not implemented (implemented: {', '.join(TOPK_METHODS)})"
        if self.expert_kind not in EXPERT_KINDS:
            return f"expert kind {self.expert_kind!r} is not implemented (implemented: {', '.join(EXPERT_KINDS)})"
        if self.num_experts_per_tok > self.num_experts:
            return f"num_experts_per_tok {self.num_experts_per_tok} exceeds the {self.num_experts} experts"
        if not isinstance(self.num_shared_experts, int) or self.num_shared_experts < 0:
            return f"n_shared_experts must be an int >= 0, got {self.num_shared_experts!r}"
        if self.topk_method == "noaux_tc" and self.scoring_func != "sigmoid":
            return f"topk_method 'noaux_tc' needs scoring_func 'sigmoid', got {self.scoring_func!r}"
        if self.topk_method in ("group_limited_greedy", "noaux_tc"):
            return self._group_problem()
        return None

    def _group_problem(self) -> str | None:
        if self.num_experts % self.n_group:
            return f"n_group {self.n_group} does not divide the {self.num_experts} experts"
        if self.topk_group > self.n_group:
            return f"topk_group {self.topk_group} exceeds n_group {self.n_group}"
        per_group = self.num_experts // self.n_group
        if self.topk_method == "noaux_tc" and per_group < 2:
            return f"noaux_tc ranks groups by their top-2 experts: n_group {self.n_group} leaves {per_group} per group"
        if self.num_experts_per_tok > self.topk_group * per_group:
            return (f"num_experts_per_tok {self.num_experts_per_tok} exceeds the {self.topk_group * per_group} experts "
                    f"of topk_group {self.topk_group} groups")
        return None


def _int(cfg: Mapping[str, Any], key: str, default: Any = None, *, alias: str | None = None) -> Any:
    v = cfg.get(key, cfg.get(alias, default) if alias else default)
    if v is None:
        raise ModelConfigError(f"mixture-of-experts config lacks {key}: set it in config.json")
    if isinstance(v, bool) or not isinstance(v, int):
        raise ModelConfigError(f"{key} must be an int, got {v!r}")
    return v


def _qwen3_moe(cfg: Mapping[str, Any]) -> MoEConfig:
    return MoEConfig(hidden_size=_int(cfg, "hidden_size"), num_experts=_int(cfg, "num_experts", alias="num_local_experts"),
                     num_experts_per_tok=_int(cfg, "num_experts_per_tok"),
                     moe_intermediate_size=_int(cfg, "moe_intermediate_size"),
                     norm_topk_prob=bool(cfg.get("norm_topk_prob", False)))


def _deepseek(cfg: Mapping[str, Any], v3: bool) -> MoEConfig:
    if not v3 and cfg.get("norm_topk_prob") and cfg.get("num_experts_per_tok", 1) > 1:
        raise ModelConfigError("norm_topk_prob true is not supported for deepseek_v2: DeepSeek's code renormalises "
                               "the top-k weights, transformers 5.24 (the parity reference) does not")
    scoring = cfg.get("scoring_func") or ("sigmoid" if v3 else "softmax")
    method = cfg.get("topk_method") or ("noaux_tc" if v3 else "greedy")
    n_group = cfg.get("n_group") or 1
    return MoEConfig(hidden_size=_int(cfg, "hidden_size"), num_experts=_int(cfg, "n_routed_experts", alias="num_local_experts"),
                     num_experts_per_tok=_int(cfg, "num_experts_per_tok"),
                     moe_intermediate_size=_int(cfg, "moe_intermediate_size"), scoring_func=scoring,
                     topk_method=method, norm_topk_prob=bool(cfg.get("norm_topk_prob", v3)),
                     routed_scaling_factor=float(cfg.get("routed_scaling_factor", 2.5 if v3 else 1.0)),
                     n_group=n_group, topk_group=cfg.get("topk_group") or n_group,
                     num_shared_experts=_int(cfg, "n_shared_experts", 1 if v3 else 2), router_fp32=True)


def _gpt_oss(cfg: Mapping[str, Any]) -> MoEConfig:
    return MoEConfig(hidden_size=_int(cfg, "hidden_size"), num_experts=_int(cfg, "num_local_experts", alias="num_experts"),
                     num_experts_per_tok=_int(cfg, "num_experts_per_tok"),
                     moe_intermediate_size=_int(cfg, "intermediate_size"), topk_method="topk_softmax",
                     expert_kind="swiglu_clamp", swiglu_limit=float(cfg.get("swiglu_limit", 7.0)),
                     swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)), expert_bias=True, router_bias=True,
                     router_name="router")


MOE_PARSERS = {"qwen3_moe": _qwen3_moe, "deepseek_v2": lambda c: _deepseek(c, False),
               "deepseek_v3": lambda c: _deepseek(c, True), "gpt_oss": _gpt_oss,
               "deepseek_v32": lambda c: _deepseek(c, True)}  # V3.2's MoE is V3's
"""model_type -> the parser of its mixture-of-experts fields."""


def parse_moe(cfg: Mapping[str, Any], model_type: str) -> MoEConfig:
    """The :class:`MoEConfig` of an HF config dict of family ``model_type`` (a key of :data:`MOE_PARSERS`).

    Raises:
        ModelConfigError: a missing or non-int count, a router or expert kind not implemented,
            inconsistent expert counts (e.g. ``num_experts_per_tok > num_experts``); the
            message names the field.
    """
    if model_type not in MOE_PARSERS:
        raise ModelConfigError(f"no mixture-of-experts parser for model_type {model_type!r} "
                               f"(known: {', '.join(MOE_PARSERS)})")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ModelConfigError(f"hidden_act {cfg['hidden_act']!r} not supported by the experts (only 'silu')")
    return MOE_PARSERS[model_type](cfg)


def sparse_layers(num_layers: int, *, first_k_dense_replace: int = 0, mlp_only_layers=(),
                  decoder_sparse_step: int = 1) -> tuple[bool, ...]:
    """Per layer: ``True`` where the MLP is the mixture of experts.

    Layer ``i`` is sparse iff ``i >= first_k_dense_replace``, ``i not in mlp_only_layers`` and
    ``(i + 1) % decoder_sparse_step == 0`` (transformers' DeepSeek and Qwen-MoE rules).

    Raises:
        ModelConfigError: ``decoder_sparse_step < 1``, ``first_k_dense_replace < 0`` or
            ``mlp_only_layers`` naming a layer outside ``[0, num_layers)``.
    """
    if not isinstance(decoder_sparse_step, int) or decoder_sparse_step < 1:
        raise ModelConfigError(f"decoder_sparse_step must be an int >= 1, got {decoder_sparse_step!r}")
    if not isinstance(first_k_dense_replace, int) or first_k_dense_replace < 0:
        raise ModelConfigError(f"first_k_dense_replace must be an int >= 0, got {first_k_dense_replace!r}")
    dense = set(mlp_only_layers or ())
    bad = sorted(i for i in dense if not isinstance(i, int) or not 0 <= i < num_layers)
    if bad:
        raise ModelConfigError(f"mlp_only_layers {bad} outside [0, {num_layers})")
    return tuple(i >= first_k_dense_replace and i not in dense and (i + 1) % decoder_sparse_step == 0
                 for i in range(num_layers))


__all__ = ["EXPERT_KINDS", "MOE_PARSERS", "MoEConfig", "SCORING_FUNCS", "TOPK_METHODS", "parse_moe", "sparse_layers"]
