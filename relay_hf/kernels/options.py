"""``AttentionOptions``: what one attention module asks of every relay call besides its tensors, in one frozen object.

Built once per attention module (``attention.module_options``) or once per call of the free functions, and handed to
the kernel plan (``plan.RelayPlan``), the custom op (as ``op_values``) and the reference (as ``reference_kwargs``).
This is the one place an attention variant is described: a new one (ALiBi's per-head slopes, say) is a field here,
its kernel work in ``jit.py`` / ``reference.py``, and its source in ``attention.py``'s glue.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

LOG2E = math.log2(math.e)  # exp(x) = exp2(x * LOG2E): the kernels work in base 2, their LSEs leave in natural log


def check_relay_options(query: torch.Tensor, softcap: float | None, sinks: torch.Tensor | None,
                        window: int | None) -> None:
    """Raise ``ValueError`` naming the option that does not fit: ``softcap > 0``, ``sinks [H_q]`` floating point on
    the query's device, ``window >= 1``."""
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be a positive float or None, got {softcap!r}")
    if sinks is not None and (sinks.shape != (query.shape[1],) or not sinks.dtype.is_floating_point
                              or sinks.device != query.device):
        raise ValueError(f"sinks must be a floating-point [H_q={query.shape[1]}] tensor on {query.device}, got "
                         f"{sinks.dtype} {tuple(sinks.shape)} on {sinks.device}")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"window must be a positive int or None, got {window!r}")


@dataclass(frozen=True, eq=False)
class AttentionOptions:
    """One attention module's options (every field optional; ``AttentionOptions()`` is plain causal attention).

    Attributes:
        scale: the softmax scale, ``D ** -0.5`` when ``None``.
        softcap: every score becomes ``softcap * tanh(score / softcap)`` before the softmax (Gemma 2), or ``None``.
        window: a sliding window: a query at absolute position ``t`` sees only keys at positions ``> t - window``;
            ``None``: no window.
        sinks: ``[H_q]`` floating point, one logit per query head that joins the softmax denominator once with no
            value (gpt-oss), or ``None``. A module's parameter: compared by identity, never copied.

    Identity, not value, is equality (a module's object is reused for every call); ``key`` is the value a kernel plan
    depends on, so modules with equal options share one plan per step.
    """

    scale: float | None = None
    softcap: float | None = None
    window: int | None = None
    sinks: torch.Tensor | None = None

    @property
    def key(self) -> tuple:
        """What a kernel plan depends on: the scale, the cap, the window and the sinks' dtype (Triton specialises a
        kernel on its pointers' dtypes, so a plan's compiled launches are per sinks dtype; read live: ``model.to``
        changes a parameter's dtype in place)."""
        return self.scale, self.softcap, self.window, None if self.sinks is None else self.sinks.dtype

    def without_window(self) -> AttentionOptions:
        """These options with no window (a window that holds every key changes nothing, and costs the kernels its
        bookkeeping)."""
        return self if self.window is None else AttentionOptions(self.scale, self.softcap, None, self.sinks)

    def same(self, scale, softcap, window, sinks) -> bool:
        """Whether these are the options of a call with these values (a module's options are built once and reused
        while it asks the same)."""
        return self.scale == scale and self.softcap == softcap and self.window == window and self.sinks is sinks

    def check(self, query: torch.Tensor) -> None:
        """Raise ``ValueError`` naming the option that does not fit a call with this ``query [B, H_q, L_q, D]``."""
        check_relay_options(query, self.softcap, self.sinks, self.window)

    @property
    def plain_softmax(self) -> bool:
        """No cap and no sinks: the softmax SDPA computes."""
        return self.softcap is None and self.sinks is None

    def kernel_scalars(self, default_scale: float) -> tuple[float, float, float]:
        """``(scale_log2, cap, cap_scale)`` as the Triton kernels take them: without a cap the scale folded into
        ``exp2``'s base-2 logits; with one, the scale goes inside the cap and the capped scores are natural-log
        logits. Raises ``ValueError`` for a scale the kernels cannot fold (they need ``scale > 0``)."""
        scale = default_scale if self.scale is None else float(self.scale)
        if not scale > 0:  # the kernels fold the scale into exp2 after the row max, which needs scale > 0
            raise ValueError(f"the Triton relay kernel needs scale > 0, got {scale}; use relay_attention_torch")
        if self.softcap is not None:
            return LOG2E, float(self.softcap), scale / self.softcap
        return scale * LOG2E, 0.0, 0.0

    def constexprs(self) -> dict:
        """The kernels' compile-time switches these options set (``jit._partials_kernel`` / ``_merge_kernel``)."""
        return dict(SOFTCAP=self.softcap is not None, WINDOW=self.window or 0, SINK=self.sinks is not None)

    def op_values(self, default_scale: float) -> list[float]:
        """The options as the custom op's ``list[float]`` (``torch.library`` takes no Python objects): ``[scale,
        cap or 0, window or 0]``; ``from_op`` reads them back. Checked options only (``check``: a cap or a window of 0
        would read back as none)."""
        scale = default_scale if self.scale is None else float(self.scale)
        return [scale, float(self.softcap or 0.0), float(self.window or 0)]

    @staticmethod
    def from_op(values: list[float], sinks: torch.Tensor | None) -> AttentionOptions:
        scale, cap, window = values
        return AttentionOptions(scale, cap or None, int(window) or None, sinks)

    def reference_kwargs(self) -> dict:
        """The keyword arguments of ``reference.relay_attention_torch``."""
        return dict(scale=self.scale, softcap=self.softcap, sinks=self.sinks, window=self.window)


OPTION_NAMES = ("scale", "softcap", "window", "sinks")
_NO_OPTIONS = AttentionOptions()  # a free function's call that names no option (frozen: one object serves them all)


def options_of(kwargs: dict) -> AttentionOptions:
    """``AttentionOptions`` from a free function's keyword arguments; ``TypeError`` naming any other keyword (as a
    Python signature would)."""
    if not kwargs:
        return _NO_OPTIONS
    unknown = sorted(k for k in kwargs if k not in OPTION_NAMES)  # (torch 2.11's dynamo fails on keys() - tuple)
    if unknown:
        raise TypeError(f"unexpected keyword argument {unknown[0]!r} (attention options: {', '.join(OPTION_NAMES)})")
    return AttentionOptions(**kwargs)


__all__ = ["LOG2E", "OPTION_NAMES", "AttentionOptions", "check_relay_options", "options_of"]
