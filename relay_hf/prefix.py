"""Finding the shared prefix of a left-padded batch, and moving between the stock and the relay row layouts.

Stock layout of row ``b`` (what the user passes, what ``generate`` returns)::

    [ pad * n_b | prefix (P) | suffix_b ]

Relay layout (what the patched ``generate`` feeds the model; same length ``T``, same tokens, reordered)::

    [ prefix (P) | pad * n_b | suffix_b ]

The prefix lands at columns ``0..P-1`` of every row, so a ``RelayCache`` holding it at batch 1 lines up with every
row, and ``generate`` only has to prefill the ``T - P`` columns after it. Position ids come out identical to stock
because they are derived from the (permuted) attention mask.
"""

from __future__ import annotations

import torch


def left_padding(attention_mask: torch.Tensor) -> torch.Tensor | None:
    """Pads in front of each row ``[B]``, or ``None`` if some row is not of the form ``0..0 1..1`` with >= 1 token."""
    mask = attention_mask.to(torch.int64)
    if ((mask != 0) & (mask != 1)).any() or (mask[:, 1:] < mask[:, :-1]).any() or (mask[:, -1] == 0).any():
        return None
    return (mask == 0).sum(-1)


def _aligned_tokens(input_ids: torch.Tensor, n_pad: torch.Tensor, length: int) -> torch.Tensor:
    """``[B, length]``: the first ``length`` real tokens of every row."""
    idx = n_pad[:, None] + torch.arange(length, device=input_ids.device)[None]
    return input_ids.gather(1, idx)


def common_prefix_length(input_ids: torch.Tensor, n_pad: torch.Tensor) -> int:
    """Longest common token prefix of the rows' real tokens, leaving at least one token after it in every row."""
    T = input_ids.shape[1]
    shortest = int(T - n_pad.max())
    if shortest <= 1:
        return 0
    tokens = _aligned_tokens(input_ids, n_pad, shortest - 1)
    same = (tokens == tokens[:1]).all(0)
    return int(same.numel() if bool(same.all()) else int((~same).int().argmax()))


def first_mismatch(input_ids: torch.Tensor, n_pad: torch.Tensor, prefix_ids: torch.Tensor) -> tuple[int, int] | None:
    """``(row, position)`` of the first row whose real tokens do not start with ``prefix_ids`` followed by at
    least one more token (position ``P`` means the row has nothing after the prefix); ``None`` if all match."""
    P, T = prefix_ids.numel(), input_ids.shape[1]
    lengths = T - n_pad
    for b in torch.nonzero(lengths <= P).flatten().tolist()[:1]:
        return b, int(lengths[b])
    tokens = _aligned_tokens(input_ids, n_pad, P)
    bad = tokens != prefix_ids.to(tokens.device)[None]
    if not bool(bad.any()):
        return None
    row = int(bad.any(1).int().argmax())
    return row, int(bad[row].int().argmax())


def relay_permutation(n_pad: torch.Tensor, P: int, T: int) -> torch.Tensor:
    """``perm [B, T]``: column ``j`` of a relay-layout row holds stock column ``perm[b, j]``."""
    j = torch.arange(T, device=n_pad.device)[None]
    n = n_pad[:, None]
    return torch.where(j < P, j + n, torch.where(j < P + n, j - P, j))


def inverse_permutation(perm: torch.Tensor) -> torch.Tensor:
    """``inv [B, T]`` with ``inv[b, perm[b, j]] = j``: gathers a relay-layout row back into stock order."""
    cols = torch.arange(perm.shape[1], device=perm.device).expand_as(perm)
    return torch.empty_like(perm).scatter_(1, perm, cols)


def to_stock_layout(ids: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
    """Map ``[R, T + t]`` relay-layout ids (``R`` = a multiple of ``B`` rows, expanded per input row) to stock
    layout; generated columns after ``T`` are unchanged."""
    T = inv.shape[1]
    inv_rows = inv.repeat_interleave(ids.shape[0] // inv.shape[0], dim=0).to(ids.device)
    return torch.cat([ids[:, :T].gather(1, inv_rows), ids[:, T:]], dim=1)
