"""``KernelConfig``: immutable, hashable, passed explicitly (or scoped by ``use_config``); launch plans cached per key;
TMA descriptors reused without keeping a prefix alive."""

import dataclasses
import gc
import importlib
import pkgutil
import weakref

import pytest
import torch

import relay_hf.kernels
from relay_hf.kernels import triton_relay
from relay_hf.kernels.plan import cached_plans
from relay_hf.kernels.tma import PrefixDescriptors
from relay_hf.kernels.triton_relay import DEFAULT_CONFIG, KernelConfig, relay_attention_triton, use_config
from tests.helpers import dense_reference, make_inputs, planned, rel_err

# these drive the kernels with CPU tensors through Triton's interpreter; on a CUDA machine test_triton_relay's cases
# run them on the device
needs_triton = pytest.mark.skipif(not (triton_relay.triton_available() and not torch.cuda.is_available()),
                                  reason="runs the kernels on CPU tensors through Triton's interpreter")


def test_config_is_frozen_and_hashable():
    with pytest.raises(dataclasses.FrozenInstanceError):
        DEFAULT_CONFIG.split_waves = 2
    same = dataclasses.replace(DEFAULT_CONFIG, split_waves=DEFAULT_CONFIG.split_waves)
    tuned = dataclasses.replace(DEFAULT_CONFIG, split_waves=DEFAULT_CONFIG.split_waves + 1)
    assert same == DEFAULT_CONFIG and hash(same) == hash(DEFAULT_CONFIG) and same is not DEFAULT_CONFIG
    assert tuned != DEFAULT_CONFIG and len({DEFAULT_CONFIG, same, tuned}) == 2
    assert tuned.split_waves == DEFAULT_CONFIG.split_waves + 1 and tuned.tiles == DEFAULT_CONFIG.tiles


def test_tile_tables_accept_a_dict_and_store_tuples():
    """``{head_dim: row}`` (how tile tables read best) is stored as sorted ``(head_dim, row)`` pairs, so the config
    stays hashable; the same table either way is the same config."""
    as_dict = {hd: row for hd, row in reversed(DEFAULT_CONFIG.suffix_tiles)}
    cfg = dataclasses.replace(DEFAULT_CONFIG, suffix_tiles=as_dict, merge_tile=list(DEFAULT_CONFIG.merge_tile))
    assert cfg == DEFAULT_CONFIG and hash(cfg) == hash(DEFAULT_CONFIG)
    assert isinstance(cfg.suffix_tiles, tuple) and isinstance(cfg.merge_tile, tuple)


@pytest.mark.parametrize("field,value", [("tiles", {64: (64, 4, 3), 128: (64, 4, 3)}),  # a head-dim class missing
                                         ("prefix_tiles", {64: (64, 4, 3), 128: (64, 4, 3), 256: (32, 8, 2)}),
                                         ("suffix_tiles", "big"), ("separate_rows", (1, 2, 3))])
def test_malformed_configs_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        KernelConfig(**{field: value})


def test_no_tunable_is_module_state():
    """The tunables live in the config only: a module attribute of an old name, in any kernels module, would be a
    setting that tunes nothing."""
    modules = [importlib.import_module(f"relay_hf.kernels.{m.name}") for m in pkgutil.iter_modules(
        relay_hf.kernels.__path__)]
    assert triton_relay in modules and len(modules) > 5
    for module in modules:
        for field in dataclasses.fields(KernelConfig):
            assert not hasattr(module, field.name.upper()), (module.__name__, field.name)


@needs_triton
def test_plan_is_built_once_per_key():
    """Layers with the same shapes share one launch plan; another config is another plan."""
    q, pk, pv, sk, sv, lens = make_inputs(2, 2, 2, 1, 5, 20, 64, dtype=torch.float16, padded=True, seed=1)
    relay_attention_triton(q, pk, pv, sk, sv, suffix_lengths=lens)
    plans = cached_plans()
    plan = planned(q, pk, pv, sk, sv, lens)
    assert plan in plans and plan.config is DEFAULT_CONFIG
    out = relay_attention_triton(q.clone(), pk.clone(), pv.clone(), sk.clone(), sv.clone(), suffix_lengths=lens)
    assert cached_plans() == plans  # a hit: the same plan objects, none added
    assert planned(q.clone(), pk.clone(), pv.clone(), sk.clone(), sv.clone(), lens) is plan
    other = dataclasses.replace(DEFAULT_CONFIG, separate_rows=(0, -1))
    assert rel_err(relay_attention_triton(q, pk, pv, sk, sv, suffix_lengths=lens, config=other), out) < 1e-3
    added = [p for p in cached_plans() if p not in plans]
    assert len(added) == 1 and added[0].config is other and added[0] is not plan


@needs_triton
def test_use_config_scopes_calls_without_a_config():
    q, pk, pv, sk, sv, lens = make_inputs(2, 2, 2, 1, 5, 20, 64, padded=True, seed=2)
    one_launch = dataclasses.replace(DEFAULT_CONFIG, separate_rows=(0, -1), max_splits=2)
    before = set(cached_plans())
    with use_config(one_launch):
        out = relay_attention_triton(q, pk, pv, sk, sv, suffix_lengths=lens)
        assert planned(q, pk, pv, sk, sv, lens).config is one_launch
    relay_attention_triton(q, pk, pv, sk, sv, suffix_lengths=lens)
    configs = {p.config for p in set(cached_plans()) - before}
    assert one_launch in configs and configs <= {one_launch, DEFAULT_CONFIG}
    assert rel_err(out, dense_reference(q, pk, pv, sk, sv, suffix_lengths=lens)) < 1e-4
    with pytest.raises(ValueError, match="KernelConfig"):
        with use_config({"split_waves": 2}):
            pass


@needs_triton
def test_cached_tma_descriptors_keep_no_prefix_alive():
    """On CUDA a plan reuses the TMA descriptors of a prefix address it has seen (every decode step of a layer); a
    descriptor holds the address, never the tensor, so a freed prefix is not kept alive. (The interpreter reads the
    tensor through its descriptor: there they are built per call; the CUDA path, by address, is driven directly.)"""
    q, pk, pv, sk, sv, lens = make_inputs(2, 2, 2, 1, 5, 128, 64, dtype=torch.bfloat16, seed=3)
    relay_attention_triton(q, pk, pv, sk, sv, suffix_lengths=lens)
    plan = planned(q, pk, pv, sk, sv, lens)
    assert plan.descriptors.enabled and not plan.descriptors.by_address  # the interpreter: built per call
    per_call = plan.descriptors.get(pk, pv)
    assert per_call[0] is not None and plan.descriptors.get(pk, pv) is not per_call and not plan.descriptors.cache
    descriptors = PrefixDescriptors(pk, pv, 64, 64, DEFAULT_CONFIG, by_address=True)  # the CUDA path
    first = descriptors.get(pk, pv)
    assert first[0] is not None and descriptors.get(pk, pv) is first
    assert not isinstance(first[0].base, torch.Tensor) and first[0].base.data_ptr() == pk.data_ptr()
    moved = make_inputs(2, 2, 2, 1, 5, 128, 64, dtype=torch.bfloat16, seed=4)[1]  # while pk lives: a new address
    alive = weakref.ref(pk)
    del pk, per_call
    gc.collect()
    assert alive() is None
    assert descriptors.get(moved, pv) is not first
    odd = torch.empty(moved.numel() + 1, dtype=moved.dtype)[1:].view(moved.shape)  # 2-byte offset base
    assert descriptors.get(odd, pv) == (None, None)
