"""relay_hf.freshness: a kept segment's check holds for the unchanged model and fails after any change that alters
its KV, wherever the change lands and however it is made (no version counter moves for any change here)."""

import pytest
import torch

from relay_hf.freshness import (
    CHECK_TOKENS,
    SegmentCheck,
    addresses,
    allocated,
    bit_sums,
    check_stream,
    partial_reach,
)
from tests.helpers import VOCAB, tiny_model

IDS = torch.randint(3, VOCAB, (24,), generator=torch.Generator().manual_seed(0))


def _record(model, ids=IDS):
    return SegmentCheck.record(model, ids, ids[CHECK_TOKENS:])


def _data_write_in_last_layer(m):  # the KV of the last layer only
    m.model.layers[-1].self_attn.k_proj.weight.data[3] += 0.1


def _embedding_row_of_a_later_token(m):  # a token the recomputed head does not contain
    row = int(IDS[-1])
    assert row not in IDS[:CHECK_TOKENS].tolist()
    m.model.embed_tokens.weight.data[row] *= 1.01


def _rotary_frequencies(m):
    m.model.rotary_emb.inv_freq.data[1] *= 1.1


def _norm_weight(m):
    m.model.layers[0].input_layernorm.weight.data[0] = 2.0


CHANGES = [_data_write_in_last_layer, _embedding_row_of_a_later_token, _rotary_frequencies, _norm_weight]


def test_an_unchanged_model_passes_its_check():
    model = tiny_model("llama")
    check = _record(model)
    with torch.no_grad():
        model(IDS[None])  # reading the model changes nothing
    assert check.holds(model, IDS)


@pytest.mark.parametrize("change", CHANGES, ids=lambda f: f.__name__.strip("_"))
def test_a_change_anywhere_fails_the_check(change):
    model = tiny_model("llama")
    check = _record(model)
    versions = [p._version for p in model.parameters()]
    change(model)
    assert [p._version for p in model.parameters()] == versions  # no counter saw it
    assert not check.holds(model, IDS)


def test_a_verdict_is_computed_unread_and_agrees_with_holds():
    """``verdict`` leaves its answer on the model's device (a 0-dim bool tensor: a caller launches more work before it
    reads it) and reads the segment's own ids from the device copy the check holds (nothing copied to the device on a
    hit); ``holds`` reads the same answer."""
    model = tiny_model("llama")
    check = _record(model)
    assert check.own.device == model.device and torch.equal(check.own, IDS[CHECK_TOKENS:])
    verdict = check.verdict(model, IDS)
    assert isinstance(verdict, torch.Tensor) and verdict.shape == () and verdict.dtype == torch.bool
    assert bool(verdict) and check.holds(model, IDS)
    _embedding_row_of_a_later_token(model)  # what only the own ids' embeddings see
    verdict = check.verdict(model, IDS)
    assert isinstance(verdict, torch.Tensor) and not bool(verdict) and not check.holds(model, IDS)


def test_experts_the_head_tokens_are_not_routed_to_are_read_in_full():
    from tests.helpers import tiny_model_of_type

    model = tiny_model_of_type("mixtral")
    found = partial_reach(model)
    expert_params = {id(p) for n, p in model.named_parameters() if "experts" in n}
    assert expert_params and expert_params <= {id(p) for p in found}
    ids = torch.randint(3, model.config.vocab_size, (12,), generator=torch.Generator().manual_seed(1))
    check = SegmentCheck.record(model, ids, ids)
    last = [p for n, p in model.named_parameters() if "experts" in n][-1]
    last.data.view(-1)[-1] += 1.0  # whichever expert it is, the check sees it
    assert not check.holds(model, ids)


def test_a_learned_position_table_is_read_in_full():
    from tests.helpers import tiny_model_of_type

    model = tiny_model_of_type("gpt2")
    table = model.transformer.wpe.weight
    assert any(p is table for p in partial_reach(model))
    assert all(p is not model.transformer.wte.weight for p in partial_reach(model))  # the input embeddings are not


def test_bit_sums_see_a_swap_and_a_sign_change():
    t = torch.tensor([1.0, -2.0, 3.0])
    assert not torch.equal(bit_sums([t]), bit_sums([t.neg()]))
    assert bit_sums([]).numel() == 0
    assert torch.equal(bit_sums([t.to(torch.bfloat16)]), bit_sums([t.to(torch.bfloat16).clone()]))


def _drop_a_parameter(m):  # the old one has no other reference: freed
    m.model.layers[0].mlp.up_proj.weight = torch.nn.Parameter(m.model.layers[0].mlp.up_proj.weight.detach().clone())


def _swap_its_data(m):  # what model.to(...) does to every parameter
    m.model.layers[-1].self_attn.o_proj.weight.data = m.model.layers[-1].self_attn.o_proj.weight.data.clone()


def _empty_its_storage(m):  # what sharded-parameter wrappers do between uses
    m.model.norm.weight.data.untyped_storage().resize_(0)


@pytest.mark.parametrize("change", [_drop_a_parameter, _swap_its_data, _empty_its_storage],
                         ids=lambda f: f.__name__.strip("_"))
def test_allocated_fails_once_a_tensor_a_graph_read_is_gone_or_moved(change):
    """A captured check reads by address, so it is launched before the walk only while every parameter and buffer
    it read is alive where it was (``allocated``); a write in place keeps them there (the check then sees it)."""
    model = tiny_model("llama")
    reads = addresses(model)
    assert allocated(reads)
    _data_write_in_last_layer(model)
    assert allocated(reads)
    change(model)
    assert not allocated(reads)


class _NoStorage(torch.Tensor):  # a wrapper subclass (as quantized weights are): no storage of its own to locate
    @staticmethod
    def __new__(cls, inner):
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype, device=inner.device)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError


def test_a_model_with_a_tensor_it_cannot_locate_is_never_launched_early():
    model = tiny_model("llama")
    assert addresses(model) is not None
    model.model.register_buffer("opaque", _NoStorage(torch.zeros(3)), persistent=False)
    assert addresses(model) is None  # its checks then run after the walk only (``_Replay.launch`` refuses)


def test_a_verdict_reads_a_launched_head_instead_of_running_the_check():
    """``verdict`` takes the head a call launched earlier (``memo["launched"]``, keyed by the check's replay) and
    compares it as it would its own run: the recorded head passes, a head off by one bit fails. Off CUDA nothing
    is captured, so nothing is launched."""
    model = tiny_model("llama")
    check = _record(model)
    assert check.launch(model) == {}
    launched = lambda head: {"launched": {id(check.replay): (check.replay, head)}}  # noqa: E731
    assert bool(check.verdict(model, IDS, launched(check.head.clone())))
    wrong = check.head.clone()
    wrong.view(torch.int32)[5] ^= 1
    assert not bool(check.verdict(model, IDS, launched(wrong)))


@pytest.mark.gpu
@pytest.mark.parametrize("change", CHANGES, ids=lambda f: f.__name__.strip("_"))
def test_on_cuda_the_check_replays_a_graph_that_sees_every_change_on_gpu(change):
    model = tiny_model("llama").cuda()
    check = _record(model)
    assert check.holds(model, IDS) and check.holds(model, IDS)
    assert check.replay.graph is not None and not check.replay.eager  # captured, replayed
    change(model)
    assert not check.holds(model, IDS)
    launched = check.launch(model)  # alive where it was: launched, and it sees the change too
    assert list(launched) == [id(check.replay)]
    assert not check.holds(model, IDS, {"launched": launched})
    _drop_a_parameter(model)
    assert check.launch(model) is None  # what its graph read is gone: refused (the call then walks first)


@pytest.mark.gpu
def test_on_cuda_the_check_runs_on_its_own_stream_after_what_the_caller_queued_on_gpu():
    """A captured check replays on a stream of its own, beside the caller's (which does not wait for it), yet after
    what the caller queued before it: a write to a parameter held back behind a long kernel is still seen."""
    model = tiny_model("llama").cuda()
    check = _record(model)
    assert check.holds(model, IDS)
    caller = torch.cuda.current_stream()
    assert check.replay.stream == check_stream(torch.device("cuda")) != caller
    assert check.replay.stream.priority < 0  # torch's high-priority pool: never its capture stream
    for launch in (False, True):
        torch.cuda.synchronize()
        weight = model.model.layers[0].self_attn.k_proj.weight
        kept = weight.detach().clone()
        torch.cuda._sleep(200_000_000)  # the write below runs long after the host has queued the check
        with torch.no_grad():
            weight.data.add_(1.0)
        memo = {"launched": check.launch(model)} if launch else {}
        answer = check.verdict(model, IDS, memo)
        assert not isinstance(answer, (bool, torch.Tensor))  # read by waiting on the check's stream only
        assert not bool(answer)
        with torch.no_grad():
            weight.data.copy_(kept)
        assert check.holds(model, IDS)
