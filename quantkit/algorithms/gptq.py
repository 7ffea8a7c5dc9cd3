"""GPTQ: second-order weight quantization (Frantar, Ashkboos, Hoefler, Alistarh, "GPTQ: Accurate Post-Training
Quantization for Generative Pre-trained Transformers", ICLR 2023, arXiv 2210.17323).

For a linear layer with weight W [N, K] and calibration inputs X [n, K], GPTQ minimises ||W X^T - Q X^T||^2 over
grid weights Q, one input column at a time. With the Hessian H = 2 X^T X / n of that objective, quantizing column
q of every row costs (w_q - quant(w_q))^2 / [H^-1]_qq, and the optimal correction of the columns not yet
quantized is

    err = (w_q - quant(w_q)) / [H^-1]_qq,        W[:, F] -= err · [H^-1]_{q, F}        (paper, eq. 2-3)

where F are the remaining columns. Paper notation below:
- ``H^-1`` is replaced by its upper Cholesky factor U (H^-1 = U^T U): row q of U restricted to the columns after q
  is exactly the inverse Hessian of the remaining columns, divided by sqrt([H_F^-1]_qq) (Step 3 of the paper), so no
  per-column inverse updates are needed and the factorisation is numerically stable.
- Lazy batch updates (Step 2): columns are taken in blocks of B; inside a block the error of each column is
  applied at once to the rest of the block, and the block's accumulated errors E [N, B] are applied to all later
  columns with one matrix product W[:, i2:] -= E · U[i1:i2, i2:].
- Dampening: ``λ = damp · mean(diag(H))`` is added to the diagonal. Dead inputs (H_ii = 0: the input was always 0)
  get H_ii = 1 and a zero weight column. If a Cholesky factorisation fails, ``damp`` grows tenfold and the
  factorisation is retried (logged); after ``MAX_RETRIES`` failures an error is raised -- never a silent RTN.
- Groups: a group's scale and zero are fixed when its first column is reached, from the weights as updated by all
  columns quantized before it. Blocks are cut at group starts, so the group's columns are up to date at that point
  (lazy updates of earlier blocks all applied). ``static_groups`` instead computes every group's grid up front from
  the original W, in the original column order.
- ``mse`` (off by default here, as in the paper): grids clip each group's range where that lowers the group's own
  rounding error, searched over 80 shrink factors; it matters most per channel, where a few outliers set the grid.
  Whether it helps a layer depends on the layer: :func:`choose_grid` decides by the output error on held-out
  calibration tokens (the gptq recipe stage's default).
- Progressive W4A8 (QServe's two-level grid, :class:`~quantkit.quant.tensor.GroupGrid`): the per-channel level-1
  scales come from the original rows, before any error feedback; each group's integer level-2 scale and zero are
  fixed like any group's grid (scale = s1 * s2, zero = z), so every code the loop picks is on the stored grid
  (the loop sees each value as (q - z) * fp32(s1 * s2), the stored weight is s1 * (s2 * (q - z)): one fp32 rounding
  apart).
- Act-order (``desc_act``): columns are processed by decreasing diag(H). Without static groups, groups are runs of
  G consecutive columns in processing order, so ``g_idx`` (the group of each ORIGINAL column) is non-monotonic;
  with static groups ``g_idx[k] = k // G``.

All math is fp32 on W's device. On CUDA the column loop of a block runs as one Triton kernel
(:mod:`quantkit.kernels.gptq.block`; blocks of at most 256 columns, which gives the same result since lazy
updates are exact), everywhere else as the PyTorch loop; a Llama-3-8B-shaped model (32 layers, 128 x 2048
calibration tokens, act-order and clipped grids) takes 81 s on an H200 (results/gptq-8b-h200-2026-12-01.md).
The returned :class:`QuantizedWeight` dequantizes exactly to the Q the algorithm chose (same codes, same
fp16-representable scales, same integer zeros).
"""

from __future__ import annotations

import logging

import torch

from quantkit.algorithms.rtn import group_qparams
from quantkit.errors import QuantkitError
from quantkit.kernels.gptq.block import MAX_BLOCK as MAX_KERNEL_BLOCK
from quantkit.kernels.gptq.block import gptq_block, gptq_block_reference
from quantkit.quant.scheme import QuantScheme
from quantkit.quant.tensor import GroupGrid, QuantizedWeight, group_index

log = logging.getLogger(__name__)

MAX_RETRIES = 6  # damp grows 10x per retry: 0.01 -> 1e4 at most
DAMP_GROWTH = 10.0
MIN_RETRY_DAMP = 1e-4  # where retries start when damp was 0


def inverse_hessian_factor(H: torch.Tensor, damp: float) -> tuple[torch.Tensor, float, int]:
    """Upper Cholesky factor U of (H + λI)^-1, λ = damp · mean(diag(H)); returns (U, damp used, retries).

    H: fp32 [K, K], symmetric, with no zero on its diagonal (dead inputs already fixed).
    """
    mean_diag = H.diagonal().mean()
    for retry in range(MAX_RETRIES + 1):
        Hd = H.clone()
        Hd.diagonal().add_(damp * mean_diag)
        L, info = torch.linalg.cholesky_ex(Hd)  # H = L L^T
        del Hd
        if int(info) == 0:
            U, info = torch.linalg.cholesky_ex(torch.cholesky_inverse(L), upper=True)  # H^-1 = U^T U
            if int(info) == 0 and bool(torch.isfinite(U).all()):
                return U, damp, retry
        if retry == MAX_RETRIES:
            break
        grown = max(damp * DAMP_GROWTH, MIN_RETRY_DAMP)
        log.warning("GPTQ: Cholesky factorisation failed with damp %.3g; retrying with damp %.3g", damp, grown)
        damp = grown
    raise QuantkitError(
        f"GPTQ: the Hessian is not positive definite even with damp {damp:.3g} after {MAX_RETRIES} retries "
        "(check the calibration data for NaN/Inf activations)"
    )


def block_step(W1, U1, s1, z1, maxq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One block of the column loop (see :mod:`quantkit.kernels.gptq.block`): a Triton kernel on CUDA, where the
    PyTorch loop is launch-bound, and the PyTorch loop elsewhere."""
    if W1.is_cuda:
        return gptq_block(W1, U1, s1, z1, maxq)
    return gptq_block_reference(W1, U1, s1, z1, maxq)


def block_bounds(K: int, block_size: int, group: int) -> list[tuple[int, int]]:
    """Column blocks [i1, i2) of at most ``block_size`` columns, also cut wherever a group starts."""
    starts = sorted(set(range(0, K, block_size)) | set(range(0, K, group)))
    return list(zip(starts, [*starts[1:], K], strict=True))


def reconstruction_loss(W: torch.Tensor, Q: torch.Tensor, H: torch.Tensor) -> float:
    """Mean squared output error per output and token: ||(W - Q) X^T||^2 / (n N) = tr(ΔW H ΔW^T) / (2 N)."""
    dW = W - Q  # [N, K]
    return float(((dW @ H) * dW).sum() / (2 * W.shape[0]))


@torch.no_grad()
def gptq(
    W: torch.Tensor,
    H: torch.Tensor,
    scheme: QuantScheme,
    damp: float = 0.01,
    block_size: int = 128,
    act_order: bool = False,
    static_groups: bool = False,
    mse: bool = False,
) -> tuple[QuantizedWeight, dict]:
    """Quantize W [N, K] to ``scheme`` with GPTQ given the Hessian H = 2 X^T X / n [K, K] of its inputs.

    Returns the quantized weight and ``{"loss", "damp", "retries", "dead_columns"}``: ``loss`` is the mean squared
    output error on the calibration inputs (see :func:`reconstruction_loss`), ``damp`` the relative dampening
    actually used (larger than asked when Cholesky retries were needed). ``mse``: each group's grid clips its
    range where that lowers the group's own rounding error (:func:`~quantkit.quant.tensor.search_qparams`) instead
    of spanning min to max; GPTQ's error feedback then works on the clipped grid.
    """
    if scheme.fmt != "int":
        raise QuantkitError(f"GPTQ quantizes to integer grids; scheme {scheme.name} is {scheme.fmt}")
    N, K = W.shape
    if H.shape != (K, K):
        raise QuantkitError(f"GPTQ: Hessian shape {tuple(H.shape)} does not match weight [N={N}, K={K}]")
    if block_size < 1 or damp < 0:
        raise QuantkitError(f"GPTQ needs block_size >= 1 and damp >= 0, got {block_size} and {damp}")
    if not bool(torch.isfinite(H).all()):
        raise QuantkitError("GPTQ: the Hessian has NaN/Inf entries")
    W0 = W.float()
    W = W0.clone()  # [N, K], updated in place
    H = H.to(device=W.device, dtype=torch.float32)
    H_obj = H  # the undamped Hessian, for the reported loss
    dead = H.diagonal() == 0
    if bool(dead.all()):
        raise QuantkitError("GPTQ: the Hessian is all zero (no calibration tokens reached this layer); use RTN")
    n_dead = int(dead.sum())
    H = H.clone()
    H.diagonal()[dead] = 1.0
    W[:, dead] = 0.0
    G = scheme.group_of(K)
    n_groups = scheme.n_groups(K)
    maxq = scheme.maxq
    grid = GroupGrid.for_weight(W, scheme, mse)  # progressive: s1 of the original rows, before error feedback

    if static_groups or n_groups == 1:
        scales, zeros = group_qparams(W, scheme, grid=grid)  # [N, n_g], groups of contiguous original columns
    else:
        scales = torch.empty(N, n_groups, device=W.device)
        zeros = torch.empty(N, n_groups, device=W.device)
    orig_group = group_index(K, scheme, device=W.device).long()  # [K]: k // G

    perm = torch.argsort(H.diagonal(), descending=True) if act_order else torch.arange(K, device=W.device)
    if act_order:
        W = W[:, perm]
        H = H[perm][:, perm]
    # group of each processed position j: static/one group -> the original column's group; else j // G
    proc_group = orig_group[perm] if (static_groups or n_groups == 1) else orig_group

    U, damp_used, retries = inverse_hessian_factor(H, damp)  # [K, K] upper
    del H
    codes = torch.empty(N, K, dtype=torch.uint8, device=W.device)  # processing order
    if W.is_cuda:  # the kernel holds a block in registers; smaller blocks give the same result (lazy updates)
        block_size = min(block_size, MAX_KERNEL_BLOCK)
    for i1, i2 in block_bounds(K, block_size, G):
        if not (static_groups or n_groups == 1) and i1 % G == 0:
            g = i1 // G  # a group starts here; W[:, i1:] holds every update from earlier blocks
            scales[:, g], zeros[:, g] = grid(W[:, i1 : i1 + G])
        s1 = scales[:, proc_group[i1:i2]]  # [N, B]: the grid of each column of the block
        z1 = zeros[:, proc_group[i1:i2]]
        Q1, E1 = block_step(W[:, i1:i2], U[i1:i2, i1:i2], s1, z1, maxq)  # codes, scaled errors [N, B]
        codes[:, i1:i2] = Q1.to(torch.uint8)
        W[:, i2:] -= E1 @ U[i1:i2, i2:]  # lazy batch update of all later columns
    del U, W

    inv = torch.argsort(perm)  # processing position of each original column
    g_idx = proc_group[inv].to(torch.int32)  # group of each original column
    qw = QuantizedWeight(codes[:, inv], scales, zeros.to(torch.int32), g_idx, scheme, grid.channel_scale)
    info = {
        "loss": reconstruction_loss(W0, qw.dequantize(), H_obj),
        "damp": damp_used,
        "retries": retries,
        "dead_columns": n_dead,
    }
    return qw, info


GRIDS = {"minmax": False, "mse": True}  # grid name -> gptq's ``mse``


@torch.no_grad()
def choose_grid(W: torch.Tensor, H_fit: torch.Tensor, H_held: torch.Tensor, scheme: QuantScheme, **kwargs):
    """``(mse, losses)``: whether GPTQ should use MSE-clipped grids for W [N, K] rather than min-max ones.

    GPTQ is fitted with each grid on the Hessian ``H_fit`` of some calibration tokens and judged by the output
    error (:func:`reconstruction_loss`) on the Hessian ``H_held`` of other tokens, which neither fit saw: a grid
    that only lowers the in-sample error does not win. Min-max wins ties (the simpler grid, the paper's).
    ``losses`` maps each grid name to its held-out error; ``kwargs`` go to :func:`gptq`.
    """
    W0 = W.float()
    H_held = H_held.to(device=W0.device, dtype=torch.float32)
    losses = {}
    for name, mse in GRIDS.items():
        qw, _ = gptq(W, H_fit, scheme, mse=mse, **kwargs)
        losses[name] = reconstruction_loss(W0, qw.dequantize(), H_held)
    return losses["mse"] < losses["minmax"], losses
