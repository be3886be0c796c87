"""``RelayPlan``: planned once per step (the step keeps it for its layers) and once per layout, run per layer; the
kernels' argument order pinned against their signatures (the direct launcher passes arguments by position)."""

import pytest
import torch

from relay_hf.kernels import attend, jit
from relay_hf.kernels.device import triton_available
from relay_hf.kernels.direct import constexpr_tail, runtime_params
from relay_hf.kernels.metadata import StepMetadata
from relay_hf.kernels.options import AttentionOptions
from relay_hf.kernels.plan import plan_for
from relay_hf.kernels.triton_relay import DEFAULT_CONFIG, cached_plans, relay_attention_triton
from tests.helpers import dense_reference, make_inputs, planned, rel_err

# CPU tensors through Triton's interpreter; on a CUDA machine test_triton_relay's cases run the kernels on the device
pytestmark = pytest.mark.skipif(not triton_available() or torch.cuda.is_available(),
                                reason="runs the kernels on CPU tensors through Triton's interpreter")


def test_argument_order_is_the_kernels_signature():
    """A launch passes runtime arguments by position (``PARTIALS_PARAMS`` / ``MERGE_PARAMS``) and then every
    constexpr in signature order; the TMA descriptors sit at ``DESCRIPTOR_SLOTS``, next to each other."""
    assert runtime_params(jit._partials_kernel) == jit.PARTIALS_PARAMS
    assert runtime_params(jit._merge_kernel) == jit.MERGE_PARAMS
    kd, vd = jit.DESCRIPTOR_SLOTS
    assert (jit.PARTIALS_PARAMS[kd], jit.PARTIALS_PARAMS[vd]) == ("KD", "VD") and vd == kd + 1
    tail = constexpr_tail(jit._merge_kernel, dict(BLOCK_R=4, BLOCK_S=2, BLOCK_D=64))
    assert tail == (4, 2, 64, False)  # SINK: its default


def _layers(n, **kw):
    """``n`` layers' tensors of one step's layout (same shapes, other values)."""
    return [make_inputs(3, 2, 2, 1, 9, 40, 64, padded=True, seed=seed, **kw) for seed in range(n)]


def test_one_plan_serves_every_layer_of_a_step():
    """The first layer of a step plans; every later layer (its own extents, the step's shared ``plans``) gets that
    plan from the step, with no new plan and no lookup by layout, and running it gives each layer what
    ``relay_attention_triton`` gives. The next step (one more suffix position) plans again."""
    layers = _layers(3, dtype=torch.bfloat16)
    plans, options = {}, AttentionOptions()
    plan = plan_for(StepMetadata(layers[0][5], None, None, plans), options, *layers[0][:5])
    kept = cached_plans()
    for q, pk, pv, sk, sv, lens in layers:
        step = StepMetadata(lens, None, None, plans)
        assert plan_for(step, options, q, pk, pv, sk, sv) is plan
        assert plan.fits(step, DEFAULT_CONFIG, q, pk, pv, sk, sv)
        out = plan.run(q, pk, pv, sk, sv, lens)
        assert torch.equal(out, relay_attention_triton(q, pk, pv, sk, sv, suffix_lengths=lens))
        assert rel_err(out, dense_reference(q, pk, pv, sk, sv, suffix_lengths=lens)) < 1e-2
    assert cached_plans() == kept and list(plans.values()) == [plan]
    grown = make_inputs(3, 2, 2, 1, 10, 40, 64, dtype=torch.bfloat16, padded=True, seed=0)  # the next step: L_s + 1
    step = StepMetadata(grown[5], None, None, plans)
    assert not plan.fits(step, DEFAULT_CONFIG, *grown[:5])
    assert not plan.fits(StepMetadata(None, None, None, plans), DEFAULT_CONFIG, *layers[0][:5])
    assert plan_for(step, options, *grown[:5]) is not plan and plans[options.key] is not plan


@pytest.mark.parametrize("name", ["prefix_key", "prefix_value", "suffix_value"])
def test_a_later_layer_laid_out_otherwise_is_checked_again(name):
    """A layer of the step whose tensors differ from the planned one in anything the plan key holds (here a dtype)
    does not run the step's plan: it plans anew, its inputs checked, and is refused by name."""
    q, pk, pv, sk, sv, lens = _layers(1)[0]
    step, options = StepMetadata(lens, None, None, {}), AttentionOptions()
    plan_for(step, options, q, pk, pv, sk, sv)
    tensors = dict(prefix_key=pk, prefix_value=pv, suffix_value=sv)
    tensors[name] = tensors[name].double()
    with pytest.raises(ValueError, match=name):
        plan_for(step, options, q, tensors["prefix_key"], tensors["prefix_value"], sk, tensors["suffix_value"])
    with pytest.raises(ValueError, match="suffix_lengths"):  # the extents' dtype too
        plan_for(StepMetadata(lens.float(), None, None, step.plans), options, q, pk, pv, sk, sv)


def test_a_step_without_plans_gets_its_layouts_plan_and_keeps_none():
    """A free function's step (``plans=None``, held by no caller) plans nothing of its own: its plan is the one
    ``plan_relay`` keeps for the layout, bound to its groups."""
    q, pk, pv, sk, sv, lens = _layers(1)[0]
    plan = plan_for(StepMetadata(lens, None, None, None), AttentionOptions(), q, pk, pv, sk, sv)
    assert plan is planned(q, pk, pv, sk, sv, lens) and plan in cached_plans()
    assert torch.equal(plan.run(q, pk, pv, sk, sv, lens), relay_attention_triton(q, pk, pv, sk, sv,
                                                                                  suffix_lengths=lens))


def test_modules_with_equal_options_share_the_step_plan():
    """Two modules' options objects with equal values find one plan; other values (a cap, a window) plan apart."""
    q, pk, pv, sk, sv, lens = _layers(1)[0]
    plans = {}
    step = StepMetadata(lens, None, None, plans)
    first = plan_for(step, AttentionOptions(0.125, 2.0, 5), q, pk, pv, sk, sv)
    assert plan_for(step, AttentionOptions(0.125, 2.0, 5), q, pk, pv, sk, sv) is first
    assert plan_for(step, AttentionOptions(0.125, 3.0, 5), q, pk, pv, sk, sv) is not first
    assert plan_for(step, AttentionOptions(0.125, 2.0, None), q, pk, pv, sk, sv) is not first
    assert len(plans) == 3


def test_a_plan_keeps_its_layout_and_config():
    q, pk, pv, sk, sv, lens = _layers(1)[0]
    plan = planned(q, pk, pv, sk, sv, lens, softcap=2.0, window=5)
    assert plan.config is DEFAULT_CONFIG and plan.layout.rows == 3
    assert plan is not planned(q, pk, pv, sk, sv, lens)  # the options are part of the layout
    assert plan is planned(q, pk, pv, sk, sv, lens, softcap=2.0, window=5)
    with pytest.raises(ValueError, match="scale > 0"):
        planned(q, pk, pv, sk, sv, lens, softcap=2.0, scale=0.0)
    with pytest.raises(ValueError, match="out must be"):
        plan.run(q, pk, pv, sk, sv, lens, out=torch.empty(1))


@pytest.mark.parametrize("L_q", [1, 3])
def test_the_default_output_is_the_transpose_of_a_contiguous_buffer(L_q):
    """The output is laid out ``[B, L_q, H_q, D]`` (the HF seam's layout): the seam takes that buffer itself."""
    q, pk, pv, sk, sv, lens = make_inputs(3, 2, 2, L_q, 9, 40, 64, padded=True, seed=L_q)
    out = relay_attention_triton(q, pk, pv, sk, sv, suffix_lengths=lens)
    assert out.shape == q.shape and out.transpose(1, 2).is_contiguous() and out.storage_offset() == 0
    assert out.untyped_storage().nbytes() == out.numel() * out.element_size()
    # the seam asks for that buffer itself (hf_layout): the same values, no view in between
    buffer = planned(q, pk, pv, sk, sv, lens).run(q, pk, pv, sk, sv, lens, hf_layout=True)
    assert buffer.shape == out.transpose(1, 2).shape and buffer.is_contiguous() and buffer._base is None
    assert torch.equal(buffer, out.transpose(1, 2))
    step, options = StepMetadata(lens, None, None, {}), AttentionOptions()
    reference = attend(step, options, q, pk, pv, sk, sv, True)  # CPU tensors: the reference, transposed for it
    assert reference.is_contiguous()
    assert torch.equal(reference, attend(step, options, q, pk, pv, sk, sv).transpose(1, 2))


# a call laid out like a planned one but for one argument, which does not fit: the plan key holds every fact the
# input checks read, so it is checked again (never served by the kept plan) and refused by name
MISFITS = {"prefix_value": (lambda a: dict(a, prefix_value=a["prefix_value"][:, :, :-1]), "prefix_value"),
           "prefix_key": (lambda a: dict(a, prefix_key=a["prefix_key"].double()), "prefix_key dtype"),
           "suffix_value": (lambda a: dict(a, suffix_value=a["suffix_value"][:, :, :-1]), "suffix_value"),
           "suffix_key": (lambda a: dict(a, suffix_key=a["suffix_key"].to("meta")), "suffix_key is on meta"),
           "suffix_lengths": (lambda a: dict(a, suffix_lengths=a["suffix_lengths"][:-1]), "suffix_lengths"),
           "suffix_end": (lambda a: dict(a, suffix_end=torch.tensor([9, 9])), "suffix_end")}


@pytest.mark.parametrize("name", list(MISFITS))
def test_a_call_that_fits_no_kept_plan_is_checked(name):
    q, pk, pv, sk, sv, lens = make_inputs(3, 2, 2, 1, 9, 40, 64, padded=True, seed=11)
    args = dict(query=q, prefix_key=pk, prefix_value=pv, suffix_key=sk, suffix_value=sv, suffix_lengths=lens,
                suffix_end=torch.tensor([9]))
    relay_attention_triton(**args)
    bad, message = MISFITS[name]
    with pytest.raises(ValueError, match=message):
        relay_attention_triton(**bad(args))
