"""The public, flash_attn 2.8-compatible entry points.

Owns argument handling order only: validate (flash_gen.validate), short-circuit empty problems, then hand the
normalized arguments to the runtime. The runtime is imported inside the call so `import flash_gen` loads
torch and nothing else: never the compiler, cuda.bindings or optuna at import time.
"""

from __future__ import annotations

import torch

from flash_gen.validate import FwdArgs, validate_fwd


def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
) -> torch.Tensor:
    """Scaled dot-product attention forward, with flash_attn 2.8's signature and semantics.

    q: (batch, seqlen_q, nheads, head_dim); k, v: (batch, seqlen_k, nheads_k, head_dim); fp16 or bf16, one CUDA
    device, stride 1 along head_dim (other strides are free: views of a packed qkv tensor are read in place).
    nheads must be a multiple of nheads_k (MQA/GQA); head_dim a multiple of 8 up to 256.
    softmax_scale defaults to head_dim ** -0.5. causal and window_size=(left, right) mask keys with the
    bottom-right alignment of flash_attn (query i sees key j iff
    i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right, -1 meaning unbounded; causal sets
    right = 0). softcap > 0 applies softcap * tanh(scores / softcap). alibi_slopes (float32, (nheads,) or
    (batch, nheads)) adds -slope * |i + seqlen_k - seqlen_q - j| to the scores. Rows that see no key output 0.
    seqlen_q or seqlen_k of 0 is allowed and launches nothing.
    deterministic is accepted for compatibility; the forward pass is always deterministic.

    Returns the output, shaped and typed like q. Forward only: no gradient flows back yet.
    Raises TypeError / ValueError naming the offending argument (see flash_gen.validate), and
    NotImplementedError for dropout_p > 0 and return_attn_probs=True.
    """
    args = validate_fwd(
        q,
        k,
        v,
        dropout_p=dropout_p,
        softmax_scale=softmax_scale,
        causal=causal,
        window_size=window_size,
        softcap=softcap,
        alibi_slopes=alibi_slopes,
        return_attn_probs=return_attn_probs,
    )
    if args.empty:
        out, _ = outputs_without_launch(q, args)
        return out
    from flash_gen.runtime.fwd import attention_fwd

    out, _ = attention_fwd(
        q,
        k,
        v,
        softmax_scale=args.softmax_scale,
        causal=args.causal,
        window_size=args.window_size,
        softcap=args.softcap,
        alibi_slopes=alibi_slopes,
    )
    return out


def outputs_without_launch(q: torch.Tensor, args: FwdArgs) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, softmax_lse) of a problem with seqlen_q or seqlen_k of 0, as the kernel would define them:
    a row that sees no key outputs 0 and has log-sum-exp +inf."""
    out = torch.zeros(args.batch, args.seqlen_q, args.nheads, args.head_dim, dtype=q.dtype, device=q.device)
    lse = torch.full((args.batch, args.nheads, args.seqlen_q), float("inf"), dtype=torch.float32, device=q.device)
    return out, lse
