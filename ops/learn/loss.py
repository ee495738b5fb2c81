"""The GRPO-family policy loss: one clipped surrogate, four published variations, as options.

Notation (per sequence i, per trained token t; `mask` is 1 on model-generated tokens):
    logp      log pi_theta(y_t)       the learner's log-probs now (carries the gradient)
    logp_old  log pi_old(y_t)         the learner's log-probs of the same weights at the start of
                                      the step (detached); None -> use logp_behaviour
    logp_beh  log mu(y_t)             vLLM's recorded log-probs of the sampled tokens
    A_i                                the sequence's advantage (ops.learn.advantages)

PPO clip (Schulman et al. 2017), per token, as GRPO (Shao et al. 2024) uses it:
    r_t = exp(logp - logp_old)
    surr_t = min(r_t * A, clip(r_t, 1 - clip_low, 1 + clip_high) * A)
DAPO (Yu et al. 2025) makes two changes, both options here: clip-higher (clip_high > clip_low,
so low-probability tokens with A > 0 can grow, against entropy collapse) and token-mean
aggregation (every token of the batch weighs the same, so long sequences are not down-weighted).

GSPO (Zheng et al. 2025, Qwen) uses one importance ratio per sequence, the geometric mean of
the token ratios, and clips whole sequences with a much smaller range (about 3e-4 / 4e-4):
    s_i = exp( mean_{t in mask_i} (logp - logp_old) )
It is computed in GSPO-token form, s_{i,t} = sg[s_i] * exp(logp_t - sg[logp_t]): the value is
s_i on every token and the gradient on token t is s_i * d logp_t, so with sequence-mean
aggregation this is exactly GSPO's objective, and both levels share one code path below.

TIS, truncated importance sampling (Yao et al. 2025, "Your efficient RL framework secretly
brings you off-policy RL training"): vLLM and the trainer compute different probabilities for
the same weights (kernels, precision), so rollouts are slightly off-policy. The surrogate of
token t is multiplied by the detached weight
    w_t = min(exp(logp_old - logp_beh), tis_cap)
(at sequence level: min(exp(mean_t (logp_old - logp_beh)), tis_cap), per sequence, to match
the GSPO ratio). When logp_old is None the ratio is already taken against logp_beh, so w = 1.

KL penalty (GRPO), the k3 estimator of KL(pi_theta || pi_ref) (Schulman, "Approximating KL
divergence"), unbiased and non-negative per token:
    k3_t = exp(logp_ref - logp) - (logp_ref - logp) - 1

Per-token loss l_t = -w_t * surr_t + kl_coef * k3_t, then aggregated:
    token-mean:    sum_{i,t} mask * l / sum mask                      (DAPO)
    sequence-mean: mean_i ( sum_t mask * l / sum_t mask_i )          (GRPO, GSPO)

Plain torch; no megatron. Entropy needs logits, so it is a separate helper.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Annotated, Literal

import torch
from pydantic import BaseModel, Field, model_validator
from torch import Tensor


class LossConfig(BaseModel):
    """The surrogate objective of one learner step."""

    model_config = {"frozen": True, "extra": "forbid"}

    level: Annotated[
        Literal["token", "sequence"],
        Field(
            description="'token': PPO/GRPO/DAPO per-token importance ratio; 'sequence': GSPO ratio "
            "exp(mean over the sequence's trained tokens of logp - logp_old), clipped per sequence"
        ),
    ] = "token"
    clip_low: Annotated[
        float,
        Field(ge=0, lt=1, description="Ratio lower clip: 1 - clip_low (PPO 0.2; GSPO about 3e-4)"),
    ] = 0.2
    clip_high: Annotated[
        float,
        Field(ge=0, description="Ratio upper clip: 1 + clip_high (DAPO clip-higher 0.28; GSPO about 4e-4)"),
    ] = 0.28
    aggregation: Annotated[
        Literal["token-mean", "sequence-mean"],
        Field(
            description="'token-mean': every trained token of the batch weighs the same (DAPO); "
            "'sequence-mean': mean over tokens within a sequence, then over sequences (GRPO, GSPO)"
        ),
    ] = "token-mean"
    tis_cap: Annotated[
        float | None,
        Field(
            gt=0,
            description="Truncated importance sampling cap C: weight = min(pi_old_train / pi_behaviour, C), "
            "detached, corrects the train/inference mismatch (Yao et al. 2025 use 2); None disables",
        ),
    ] = 2.0
    kl_coef: Annotated[
        float,
        Field(ge=0, description="Weight of the k3 KL(pi_theta || pi_ref) penalty; 0 disables (DAPO drops it)"),
    ] = 0.0
    off_policy: Annotated[
        Literal["clip", "shaped", "sft"],
        Field(
            description="How reference rows (a task's verified solution written into its group) are trained. "
            "'clip': in their group with its advantage, as if the policy had sampled them: ratio against the "
            "learner's start-of-step weights with the usual clip, no TIS weight, so each step's first update is the "
            "full advantage-weighted gradient however unlikely the solution was; 'shaped': in their group with "
            "LUFFY's policy shaping (Yan et al. 2025), surrogate A * p / (p + shaping_gamma), bounded and unclipped; "
            "'sft': outside the groups, trained by the supervised term alone (rejection-sampling fine-tuning)"
        ),
    ] = "clip"
    shaping_gamma: Annotated[float, Field(gt=0, description="LUFFY's shaping constant ('shaped')")] = 0.1
    entropy_coef: Annotated[
        float, Field(ge=0, description="Weight of the entropy bonus -coef * H (token-mean over trained tokens); the "
                     "starting value when entropy_target is set")
    ] = 0.0
    entropy_target: Annotated[
        float | None,
        Field(gt=0, description="Adaptive entropy bonus: after each update the coefficient moves by entropy_coef_lr * "
              "(target - entropy), within [0, entropy_coef_max], so the policy's entropy (nats/token) is held near "
              "the target instead of collapsing; None keeps entropy_coef fixed"),
    ] = None
    entropy_coef_lr: Annotated[float, Field(gt=0, description="Step of the adaptive entropy coefficient")] = 0.05
    entropy_coef_max: Annotated[float, Field(ge=0, description="Largest adaptive entropy coefficient")] = 0.05
    sft_coef: Annotated[
        float,
        Field(ge=0, description="Weight of a supervised term sft_coef * NLL on reference rows, added to what off_policy "
              "does with them (an unclipped push on solution tokens the policy finds unlikely, which the clip would "
              "stop after one update); 'sft' needs it > 0. Default 1.0, chosen with `perpetua bench learning`"),
    ] = 1.0
    anchor_solved: Annotated[
        bool,
        Field(description="Keep the samples of all-pass groups (replayed solved tasks, no policy-gradient signal) as "
              "supervised rows: sft_coef * NLL on the policy's own verified successes, which holds what it has "
              "learned while the step trains other families (needs sft_coef > 0)"),
    ] = False
    anchors_per_group: Annotated[
        int | None,
        Field(ge=1, description="With anchor_solved, keep at most this many samples of each all-pass group (the "
              "first by sample index): every solved task still anchors, with fewer rows to outweigh the families "
              "the step is learning; None = all of them"),
    ] = None

    @model_validator(mode="after")
    def _check(self) -> "LossConfig":
        if self.off_policy == "sft" and self.sft_coef <= 0:
            raise ValueError("off_policy 'sft' trains reference rows by the supervised term alone: set sft_coef > 0")
        if self.anchor_solved and self.sft_coef <= 0:
            raise ValueError("anchor_solved trains all-pass groups by the supervised term alone: set sft_coef > 0")
        return self

    @classmethod
    def gspo(cls, **overrides) -> LossConfig:
        """GSPO's published setting: sequence ratio, clip 3e-4 / 4e-4, sequence-mean."""
        base = {"level": "sequence", "clip_low": 3e-4, "clip_high": 4e-4, "aggregation": "sequence-mean"}
        return cls(**(base | overrides))


@dataclass(frozen=True)
class LossStats:
    """What the step did, as plain floats (ready for MLflow). "unit" = masked token at level
    'token', sequence with at least one trained token at level 'sequence'.

    loss = pg_loss + kl_coef * kl holds exactly (both use the configured aggregation).
    """

    loss: float
    pg_loss: float  # aggregated -w * surr
    kl: float  # aggregated k3 (computed whenever logp_ref is given, added only if kl_coef > 0)
    clip_fraction: float  # share of units whose clip was active (gradient cut): low + high
    clip_low_fraction: float  # A < 0 and ratio < 1 - clip_low
    clip_high_fraction: float  # A > 0 and ratio > 1 + clip_high
    ratio_mean: float  # over units
    ratio_max: float
    ratio_min: float
    tis_weight_mean: float  # over units; 1.0 when TIS is off or logp_old is None
    mismatch: float  # mean |logp_old - logp_behaviour| over sampled masked tokens (not reference rows); 0.0 when logp_old is None
    num_tokens: float  # masked tokens in this batch
    num_sequences: float  # sequences with at least one trained token

    def as_dict(self, prefix: str = "") -> dict[str, float]:
        return {f"{prefix}{k}": v for k, v in asdict(self).items()}


def grpo_loss(
    logp: Tensor,
    logp_old: Tensor | None,
    logp_behaviour: Tensor,
    advantages: Tensor,
    mask: Tensor,
    cfg: LossConfig,
    logp_ref: Tensor | None = None,
    *,
    loss_normalizer: float | None = None,
    off_policy: Tensor | None = None,
    entropy: Tensor | None = None,
    entropy_coef: float = 0.0,
) -> tuple[Tensor, LossStats]:
    """Clipped policy-gradient loss for one (micro-)batch; see the module docstring for the math.

    All tensors [B, T] except advantages [B]. Values at masked positions are never read (they may
    be anything, even inf), so tool tokens and padding have no effect on loss or gradient.
    `loss_normalizer` replaces the local denominator (trained tokens for token-mean, sequences for
    sequence-mean) so that micro-batches of one step can share the global one under gradient
    accumulation. `off_policy` [B] bool marks reference rows, trained as `cfg.off_policy` says. `entropy` [B, T]
    (per-token entropy of the policy, with its gradient) adds the bonus -entropy_coef * H, aggregated
    like the loss, on sampled tokens only (a reference row's tokens are not the policy's choices). A batch with no trained token gives a zero loss still attached to the graph,
    so every data-parallel rank can call backward.
    """
    _check_inputs(logp, logp_old, logp_behaviour, advantages, mask, logp_ref, cfg, loss_normalizer)
    x = _Masked.of(logp, logp_old, logp_behaviour, advantages, mask)
    ratio, log_w = _importance_ratio(x, cfg.level)
    tis_w = torch.ones_like(x.lp) if cfg.tis_cap is None else torch.exp(log_w).clamp(max=cfg.tis_cap)
    surr = _clipped_surrogate(ratio, x.adv, cfg)
    sampled = x.mf  # tokens an engine sampled: the train/inference mismatch is measured on these
    if off_policy is not None and bool(off_policy.any()):
        off = off_policy.bool()[:, None].expand_as(x.lp)
        sampled = x.mf * (~off).float()
        tis_w = torch.where(off, torch.ones_like(tis_w), tis_w)  # the behaviour is the solution, not an engine
        if cfg.off_policy == "shaped":
            p = torch.exp(x.lp)
            surr = torch.where(off, x.adv * p / (p + cfg.shaping_gamma), surr)
        elif cfg.off_policy == "sft":
            surr = torch.where(off, x.zero, surr)
        if cfg.sft_coef > 0:
            surr = torch.where(off, surr + cfg.sft_coef * x.lp, surr)
    pg_tok = -tis_w * surr
    k3 = None if logp_ref is None else _k3(x.masked(logp_ref.detach()), x.lp)

    pg_loss = _aggregate(pg_tok, x, cfg.aggregation, loss_normalizer)
    kl = _aggregate(k3, x, cfg.aggregation, loss_normalizer) if k3 is not None else x.zero
    loss = pg_loss + cfg.kl_coef * kl if cfg.kl_coef > 0 else pg_loss
    if entropy is not None and entropy_coef > 0:
        loss = loss - entropy_coef * _aggregate(torch.where(sampled.bool(), entropy, x.zero), x, cfg.aggregation,
                                                loss_normalizer)
    if x.n_tokens == 0:
        loss = (logp * 0).sum()  # nothing to train; keep the graph so backward runs
    stats = _loss_stats(loss, pg_loss, kl, ratio, tis_w, x, cfg, on_behaviour=logp_old is None, sampled=sampled)
    return loss, stats


def _check_inputs(logp, logp_old, logp_behaviour, advantages, mask, logp_ref, cfg: LossConfig,
                  loss_normalizer: float | None) -> None:
    if logp.ndim != 2:
        raise ValueError(f"logp must be [B, T], got shape {tuple(logp.shape)}")
    for name, t in (("logp_old", logp_old), ("logp_behaviour", logp_behaviour), ("mask", mask), ("logp_ref", logp_ref)):
        if t is not None and t.shape != logp.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(logp.shape)} like logp")
    if advantages.shape != logp.shape[:1]:
        raise ValueError(f"advantages must be [B]={logp.shape[0]}, got shape {tuple(advantages.shape)}")
    if cfg.kl_coef > 0 and logp_ref is None:
        raise ValueError("kl_coef > 0 needs logp_ref (the reference policy's log-probs)")
    if loss_normalizer is not None and not loss_normalizer > 0:
        raise ValueError(f"loss_normalizer must be > 0, got {loss_normalizer}")


@dataclass(frozen=True)
class _Masked:
    """The inputs with masked positions set to 0 before any exp, so inf/nan there stay harmless;
    old and behaviour log-probs and advantages detached (only logp carries the gradient)."""

    m: Tensor  # [B, T] bool
    mf: Tensor  # [B, T] float32
    zero: Tensor  # scalar float32 on logp's device
    lp: Tensor
    lp_old: Tensor  # lp_beh when logp_old is None
    lp_beh: Tensor
    adv: Tensor  # [B, 1]
    tokens_per_seq: Tensor  # [B]
    has_tokens: Tensor  # [B] bool
    n_tokens: float
    n_seqs: float

    @classmethod
    def of(cls, logp, logp_old, logp_behaviour, advantages, mask) -> "_Masked":
        m = mask.bool()
        mf = m.to(torch.float32)
        zero = torch.zeros((), dtype=torch.float32, device=logp.device)
        lp_beh = _zero_masked(logp_behaviour.detach(), m, zero)
        tokens_per_seq = mf.sum(dim=1)
        has_tokens = tokens_per_seq > 0
        return cls(
            m=m, mf=mf, zero=zero, lp=_zero_masked(logp, m, zero), lp_beh=lp_beh,
            lp_old=lp_beh if logp_old is None else _zero_masked(logp_old.detach(), m, zero),
            adv=advantages.detach().float()[:, None], tokens_per_seq=tokens_per_seq, has_tokens=has_tokens,
            n_tokens=float(tokens_per_seq.sum().item()), n_seqs=float(has_tokens.sum().item()),
        )

    def masked(self, t: Tensor) -> Tensor:
        return _zero_masked(t, self.m, self.zero)


def _zero_masked(t: Tensor, m: Tensor, zero: Tensor) -> Tensor:
    return torch.where(m, t.float(), zero)


def _importance_ratio(x: _Masked, level: str) -> tuple[Tensor, Tensor]:
    """(ratio pi_theta / pi_old, log of the TIS weight pi_old / mu), both [B, T]: per token, or
    per sequence in GSPO-token form (value s_i on every token, gradient s_i * d logp_t)."""
    if level == "token":
        return torch.exp(x.lp - x.lp_old), x.lp_old - x.lp_beh
    denom = x.tokens_per_seq.clamp(min=1)
    seq_log_ratio = (x.lp - x.lp_old).sum(dim=1) / denom
    ratio = torch.exp(seq_log_ratio.detach())[:, None] * torch.exp(x.lp - x.lp.detach())
    log_w = ((x.lp_old - x.lp_beh).sum(dim=1) / denom)[:, None].expand_as(x.lp)
    return ratio, log_w


def _clipped_surrogate(ratio: Tensor, adv: Tensor, cfg: LossConfig) -> Tensor:
    """PPO's pessimistic surrogate min(r * A, clip(r, 1 - clip_low, 1 + clip_high) * A)."""
    clipped = ratio.clamp(1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
    return torch.minimum(ratio * adv, clipped * adv)


def _k3(lp_ref: Tensor, lp: Tensor) -> Tensor:
    """k3 estimator of KL(pi_theta || pi_ref) per token: unbiased and non-negative, clamped as
    verl's `low_var_kl` is (log-ratio to [-20, 20], the value to at most 10). Unclamped, a token
    the policy has made far less likely than the reference does (after supervised updates, say)
    gives exp(logp_ref - logp) in the millions, and after the gradient clip the step is the
    penalty's alone; a clamped token adds no gradient."""
    d = (lp_ref - lp).clamp(min=-20.0, max=20.0)
    return (torch.exp(d) - d - 1.0).clamp(max=10.0)


def _aggregate(x: Tensor, inputs: _Masked, aggregation: str, loss_normalizer: float | None) -> Tensor:
    """Masked per-token values -> one number: token-mean (DAPO) or sequence-mean (GRPO, GSPO)."""
    x = x * inputs.mf
    if aggregation == "token-mean":
        return x.sum() / (loss_normalizer if loss_normalizer is not None else max(inputs.n_tokens, 1.0))
    per_seq = x.sum(dim=1) / inputs.tokens_per_seq.clamp(min=1)
    return per_seq.sum() / (loss_normalizer if loss_normalizer is not None else max(inputs.n_seqs, 1.0))


@torch.no_grad()
def _loss_stats(loss: Tensor, pg_loss: Tensor, kl: Tensor, ratio: Tensor, tis_w: Tensor, x: _Masked,
                cfg: LossConfig, *, on_behaviour: bool, sampled: Tensor) -> LossStats:
    """LossStats over units (trained tokens, or sequences with one at level 'sequence')."""
    if cfg.level == "token":
        unit, r, a, w = x.m, ratio, x.adv.expand_as(ratio), tis_w
    else:
        unit, r, a, w = x.has_tokens, ratio[:, 0], x.adv[:, 0], tis_w[:, 0]
    r_u, a_u, w_u = r[unit], a[unit], w[unit]
    n_units = max(int(unit.sum().item()), 1)
    low = ((a_u < 0) & (r_u < 1.0 - cfg.clip_low)).sum().item() / n_units
    high = ((a_u > 0) & (r_u > 1.0 + cfg.clip_high)).sum().item() / n_units
    empty = r_u.numel() == 0
    n_sampled = float(sampled.sum())
    mismatch = 0.0 if on_behaviour or n_sampled == 0 else float(((x.lp_old - x.lp_beh).abs() * sampled).sum() / n_sampled)
    return LossStats(
        loss=float(loss.detach()),
        pg_loss=float(pg_loss.detach()),
        kl=float(kl.detach()),
        clip_fraction=low + high,
        clip_low_fraction=low,
        clip_high_fraction=high,
        ratio_mean=1.0 if empty else float(r_u.mean()),
        ratio_max=1.0 if empty else float(r_u.max()),
        ratio_min=1.0 if empty else float(r_u.min()),
        tis_weight_mean=1.0 if empty else float(w_u.mean()),
        mismatch=mismatch,
        num_tokens=x.n_tokens,
        num_sequences=x.n_seqs,
    )


def token_entropy(logits: Tensor) -> Tensor:
    """Per-position entropy H = -sum_v p_v log p_v of logits [B, T, V] -> [B, T] (with its gradient)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(dim=-1)


def adapt_entropy_coef(coef: float, entropy: float, cfg: LossConfig) -> float:
    """The adaptive entropy coefficient after an update that measured `entropy` (nats/token)."""
    if cfg.entropy_target is None:
        return coef
    return min(max(coef + cfg.entropy_coef_lr * (cfg.entropy_target - entropy), 0.0), cfg.entropy_coef_max)


def entropy_from_logits(logits: Tensor, mask: Tensor) -> Tensor:
    """Mean per-token entropy H = -sum_v p_v log p_v over masked positions of logits [B, T, V].

    A falling entropy is the early sign of the collapse clip-higher is meant to prevent. It
    builds a [B, T, V] temporary: call it under torch.no_grad() when it is only a metric.
    """
    if logits.ndim != 3 or logits.shape[:2] != mask.shape:
        raise ValueError(f"logits must be [B, T, V] with mask [B, T]; got {tuple(logits.shape)} and {tuple(mask.shape)}")
    ent = token_entropy(logits)
    mf = mask.bool().to(ent.dtype)
    return (ent * mf).sum() / mf.sum().clamp(min=1)
