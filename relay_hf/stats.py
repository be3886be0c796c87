"""``relay_hf.stats(model)``: what relay saved on a patched model since ``patch``, as one frozen snapshot.

The counters are kept by every road that serves relay: ``generate``, the pipeline and continuous batching
(``generate_batch``, ``init_continuous_batching``, ``relay-hf serve``). Updates take a lock, so concurrent calls on
one model count exactly; ``unpatch`` drops them with the rest of the patch.
"""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass, field, fields

import torch


@dataclass(frozen=True)
class RelayStats:
    """Counters since ``patch`` (all ints).

    Attributes:
        relay_steps: decode steps (continuous batching: forward steps) in which relay read a shared prefix once for
            several rows.
        relay_rows: rows those steps served (one per row and step).
        kv_bytes_not_reread: prefix KV bytes (keys and values, every layer) those steps did not read again: per step,
            ``(readers - 1) * tokens`` of each shared segment, times the bytes of one token's KV.
        prefix_hits: calls (pipeline batches, ``generate`` calls) whose shared prefix came from the prefix store
            instead of a prefill.
        prefill_tokens_saved: prefix tokens those hits did not prefill again.
        stock_calls: calls relay_hf handed to stock transformers (``relay_last_decision`` says why).
    """

    relay_steps: int = 0
    relay_rows: int = 0
    kv_bytes_not_reread: int = 0
    prefix_hits: int = 0
    prefill_tokens_saved: int = 0
    stock_calls: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


_NAMES = tuple(f.name for f in fields(RelayStats))


@dataclass(eq=False)
class Counters:
    """The mutable side of ``RelayStats``, owned by a model's ``RelayState``."""

    _values: dict = field(default_factory=lambda: dict.fromkeys(_NAMES, 0))
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, **amounts: int) -> None:
        with self._lock:
            for name, amount in amounts.items():
                self._values[name] += int(amount)

    def snapshot(self) -> RelayStats:
        with self._lock:
            return RelayStats(**self._values)


def kv_bytes_per_token(model) -> int:
    """Bytes of one token's keys and values over every layer of ``model`` in its dtype: from the attention modules'
    key and value projections where they have them (per-layer head counts and dims, as Gemma 4's), else from the
    text config."""
    widths = [m.k_proj.out_features + m.v_proj.out_features for m in model.modules()
              if isinstance(getattr(m, "k_proj", None), torch.nn.Linear)
              and isinstance(getattr(m, "v_proj", None), torch.nn.Linear)]
    if widths:
        return sum(widths) * model.dtype.itemsize
    text = model.config.get_text_config(decoder=True)
    heads = getattr(text, "num_attention_heads", 1)
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    value_dim = getattr(text, "v_head_dim", None) or head_dim
    layers = getattr(text, "num_hidden_layers", 1)
    return layers * kv_heads * (head_dim + value_dim) * model.dtype.itemsize


def stats(model) -> RelayStats:
    """The counters of a patched ``model`` (``ValueError`` for a model ``relay_hf.patch`` has not patched)."""
    state = getattr(model, "__dict__", {}).get("_relay_state")
    if state is None:
        raise ValueError("relay_hf.stats takes a model patched by relay_hf.patch")
    return state.counters.snapshot()
