"""``KernelConfig``: every tunable of the Triton relay kernels in one frozen, hashable object (tile tables, work split,
launch layout), passed explicitly or scoped by ``use_config``. Nothing here imports Triton.

Measurements behind each default: docs/performance.md, kernel section.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator, Mapping

HEAD_DIM_CLASSES = (64, 128, 256)  # tile tables are keyed by the padded head dim, clamped to this range

TileTable = tuple[tuple[int, tuple[int, ...]], ...]


def _tile_table(value, width: int, name: str) -> TileTable:
    """A tile table as a sorted tuple of ``(head-dim class, row)`` pairs; a ``{class: row}`` mapping is accepted."""
    try:
        items = value.items() if isinstance(value, Mapping) else value
        table = tuple(sorted((int(k), tuple(int(x) for x in row)) for k, row in items))
    except (TypeError, ValueError):
        table = ()
    if tuple(k for k, _ in table) != HEAD_DIM_CLASSES or any(len(row) != width for _, row in table):
        raise ValueError(f"KernelConfig.{name} must map the head-dim classes {HEAD_DIM_CLASSES} to {width} ints each, "
                         f"got {value!r}")
    return table


def tile_row(table: TileTable, block_d: int) -> tuple[int, ...]:
    """The row of a tile table for a padded head dim ``block_d`` (clamped into ``HEAD_DIM_CLASSES``)."""
    return dict(table)[min(max(block_d, HEAD_DIM_CLASSES[0]), HEAD_DIM_CLASSES[-1])]


# --- every tunable, in one visible place (measurements: docs/performance.md, kernel section) -----------------------
@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Tile tables, work split and launch layout of the Triton relay kernels: immutable and hashable, so a launch plan
    is cached per config. Never mutate a module to tune; build a variant and pass it::

        cfg = dataclasses.replace(DEFAULT_CONFIG, split_waves=2, partial_budget=4)
        relay_attention_triton(q, pk, pv, sk, sv, config=cfg)
        with use_config(cfg):  # calls made deeper down (a patched model, the custom op) without a config argument
            model.generate(...)

    Tile tables (``tiles``, ``suffix_tiles``, ``prefix_tiles``) map the padded head dim ``BLOCK_D`` (64, 128, 256;
    clamped into that range) to a row; a ``{64: row, 128: row, 256: row}`` dict is accepted and stored as a tuple of
    ``(head_dim, row)`` pairs.
    """

    # one-launch layout: head dim -> (BLOCK_N keys per tile, warps, stages)
    tiles: TileTable = ((64, (64, 4, 3)), (128, (64, 4, 3)), (256, (32, 8, 2)))
    # query rows per prefix program; small batches use the smallest tl.dot tile (16)
    max_block_m: int = 64
    # prefix units alone aim for this many programs per SM
    split_waves: int = 4
    # suffix units alone aim for this many programs per SM (the suffix is split when B*H_kv is small)
    suffix_waves: int = 1
    # prefix-partial traffic stays <= 1/partial_budget of the prefix bytes
    partial_budget: int = 2
    max_splits: int = 32
    # merge kernel: (rows x slots per program, warps); a program merges max(1, rows x slots // slots) rows
    merge_tile: tuple[int, int] = (16, 2)
    # fp16/bf16: partial outputs in the input dtype (half the scratch bytes; LSE stays fp32), docs/performance.md
    partial_half: bool = True
    # N = B*G*L_q rows in this range run as separate prefix and suffix launches, each with its own tiles (won at 128+
    # rows, lost at 32, and at 16384 x 128 a tail wave of prefix programs: docs/performance.md)
    separate_rows: tuple[int, int] = (64, 512)
    # separate layout's suffix launch: head dim -> (BLOCK_N, warps, stages); its lighter programs fit 3-5 per SM
    suffix_tiles: TileTable = ((64, (32, 4, 3)), (128, (32, 4, 3)), (256, (32, 8, 2)))
    # separate layout's prefix launch: (waves, budget), split for whole waves only (no tail wave, docs/performance.md)
    separate_split: tuple[int, int] = (2, 4)
    # the separate suffix launch merges the prefix partials itself (no merge launch) while there are at most
    # fused_merge_slots of them and its [rows, slots] merge tile has at most fused_merge_tile elements
    fused_merge_slots: int = 16
    fused_merge_tile: int = 512
    # separate layout's prefix launch: head dim -> (BLOCK_M, BLOCK_N, warps, stages); 128-row blocks were slower
    prefix_tiles: TileTable = ((64, (64, 64, 4, 3)), (128, (64, 64, 4, 3)), (256, (64, 32, 8, 2)))
    # prefix K/V full tiles through TMA descriptors (Hopper+ or the interpreter; fp16/bf16, head dim a power of two,
    # 16-byte aligned strides and base): no address registers, no per-element predicates
    prefix_tma: bool = True
    # programmatic dependent launch (Hopper+) of the fused suffix launch only: it streams its suffix while the prefix
    # launch runs and waits before the merge (it lost wherever programs wait without merging: docs/performance.md)
    pdl: bool = True
    # paired suffix units: where the prefix launch runs at most one program per SM, the prefix has at least
    # suffix_pair_min_prefix tokens and more than suffix_pair_above fused suffix programs per SM would queue, each
    # suffix program streams two batch rows before its PDL wait (None: never; docs/performance.md)
    suffix_pair_above: int | None = 3
    suffix_pair_min_prefix: int = 2048
    # SM count the work split plans for; None: the device's (a smaller share of the GPU, or a test planning for a
    # large GPU on a small one)
    num_sms: int | None = None
    # after a plan's first call, launch the kernels Triton compiled for it directly (host time: Triton's per-call
    # argument specialisation is skipped; the call's strides and 16-byte alignment are part of the reuse key)
    reuse_compiled: bool = True

    def __post_init__(self):
        for name, width in (("tiles", 3), ("suffix_tiles", 3), ("prefix_tiles", 4)):
            object.__setattr__(self, name, _tile_table(getattr(self, name), width, name))
        for name in ("merge_tile", "separate_rows", "separate_split"):
            value = tuple(getattr(self, name))
            if len(value) != 2:
                raise ValueError(f"KernelConfig.{name} must be a pair, got {getattr(self, name)!r}")
            object.__setattr__(self, name, value)
        # hashed once: the config is part of every call's plan key
        object.__setattr__(self, "_hash", hash(dataclasses.astuple(self)))

    def __hash__(self) -> int:
        return self._hash


DEFAULT_CONFIG = KernelConfig()
_ACTIVE_CONFIG: contextvars.ContextVar[KernelConfig] = contextvars.ContextVar("relay_kernel_config",
                                                                              default=DEFAULT_CONFIG)


@contextlib.contextmanager
def use_config(config: KernelConfig) -> Iterator[KernelConfig]:
    """Within the block, calls that pass no ``config`` (``relay_attention``, the custom op, a patched model) use this
    one. A CUDA graph or compiled step captured inside keeps the launches it captured."""
    if not isinstance(config, KernelConfig):
        raise ValueError(f"use_config needs a KernelConfig, got {type(config).__name__}")
    token = _ACTIVE_CONFIG.set(config)
    try:
        yield config
    finally:
        _ACTIVE_CONFIG.reset(token)


def active_config() -> KernelConfig:
    """The configuration calls without a ``config`` argument use now (``use_config``'s, else ``DEFAULT_CONFIG``)."""
    return _ACTIVE_CONFIG.get()


def resolve_config(config: KernelConfig | None) -> KernelConfig:
    """``config`` itself, or the active one for ``None``; ``ValueError`` for anything else."""
    if config is None:
        return _ACTIVE_CONFIG.get()
    if not isinstance(config, KernelConfig):
        raise ValueError(f"config must be a KernelConfig, got {type(config).__name__}")
    return config


__all__ = ["DEFAULT_CONFIG", "HEAD_DIM_CLASSES", "KernelConfig", "TileTable", "active_config", "resolve_config",
           "tile_row", "use_config"]
