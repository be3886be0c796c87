"""The few places where transformers 5.17 .. 5.x differ for us, answered by looking, not by version numbers."""

from __future__ import annotations

import gc
import inspect
from functools import cache


@cache
def _forward_cache_name(forward_qualname: str, params: tuple[str, ...]) -> str:
    return "cache" if "cache" in params else "past_key_values"


def cache_kwarg_name(model) -> str:
    """The keyword under which ``model``'s forward (and generate) takes the cache.

    transformers 5.24 renamed ``past_key_values`` to ``cache``; the old name still works there but warns.
    """
    forward = model.base_model.forward
    return _forward_cache_name(forward.__qualname__, tuple(inspect.signature(forward).parameters))


def output_cache(output):
    """The cache carried by a generate/forward output, under whichever field name this version uses."""
    for name in ("cache", "past_key_values"):
        value = output.get(name) if hasattr(output, "get") else getattr(output, name, None)
        if value is not None:
            return value
    return None


# -- attention implementations ---------------------------------------------------------------------------------------
def attn_implementation(config) -> str | None:
    """The attention implementation a config selects (transformers keeps it in a private field)."""
    return getattr(config, "_attn_implementation", None)


def can_set_attn_implementation(model) -> bool:
    """Whether ``model`` routes attention through the ``AttentionInterface`` and lets it be switched."""
    return bool(getattr(model, "_supports_attention_backend", False)) and model._can_set_attn_implementation()


def registered_attention(name: str):
    """The attention function transformers registered under ``name``."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS[name]


def registered_mask(name: str):
    """The mask function transformers registered under ``name``, or ``None`` (that implementation builds none)."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    return ALL_MASK_ATTENTION_FUNCTIONS._global_mapping.get(name)


@cache
def _eager_of(module_name: str):
    import sys

    fn = getattr(sys.modules.get(module_name), "eager_attention_forward", None)
    if fn is None:
        raise ValueError(f"{module_name} defines no eager_attention_forward; relay_hf cannot run its eager attention")
    return fn


def eager_attention_function(module):
    """The ``eager_attention_forward`` that ``module``'s modeling file uses when the model runs eager attention."""
    return _eager_of(type(module).__module__)


# -- generate ------------------------------------------------------------------------------------------------------
def resolve_generation_config(model, generation_config, kwargs: dict):
    """``(generation_config, model_kwargs)`` exactly as stock ``generate`` resolves them: user kwargs over the passed
    config over ``model.generation_config`` over the library defaults (a private method of ``GenerationMixin``)."""
    return model._prepare_generation_config(generation_config, **kwargs)


def logits_processors(model, generation_config, input_ids, attention_mask):
    """The ``LogitsProcessorList`` stock ``generate`` builds for this call (``input_ids`` / ``attention_mask``
    ``[B, T]`` in stock layout): its special-token tensors prepared on a copy of the config, then its processor
    list, through two private methods of ``GenerationMixin``."""
    import copy

    from transformers import LogitsProcessorList

    gen = copy.deepcopy(generation_config)
    model._prepare_special_tokens(gen, True, device=input_ids.device)
    return model._get_logits_processor(generation_config=gen, input_ids_seq_length=input_ids.shape[1],
                                       encoder_input_ids=input_ids, prefix_allowed_tokens_fn=None,
                                       logits_processor=LogitsProcessorList(), device=input_ids.device,
                                       model_kwargs={"attention_mask": attention_mask})


def optimized_for_decode(model):
    """The context stock ``generate`` runs its decode steps in (a private method of ``GenerationMixin``: off the
    CPU it switches an MoE's experts from ``grouped_mm``, which reads expert offsets on the host, to ``batched_mm``);
    relay_hf's loop decodes in it too, so its steps compute what stock's do and can be captured. A no-op where the
    installed transformers has none."""
    import contextlib

    optimize = getattr(model, "_optimize_model_for_decode", None)
    return contextlib.nullcontext() if optimize is None else optimize()


def compile_all_devices(compile_config) -> bool:
    """Whether a ``CompileConfig`` asks transformers to compile on every device, not only CUDA."""
    return bool(getattr(compile_config, "_compile_all_devices", False))


@cache
def _reads_original_max_positions(method) -> bool:
    try:
        return "original_max_position_embeddings" in inspect.getsource(method)
    except (OSError, TypeError):
        return False


def cache_recomputed_past(model) -> int | None:
    """The config's ``original_max_position_embeddings`` where ``model``'s own ``prepare_inputs_for_generation`` drops
    the cache once the ids pass it and recomputes the whole sequence in one forward (Phi-3, PhiMoE,
    Phi-4-multimodal: their longrope switches to its long factors there), else ``None``. Read from the method's
    source: nothing else says so."""
    limit = getattr(model.config, "original_max_position_embeddings", None)
    method = getattr(type(model), "prepare_inputs_for_generation", None)
    if not isinstance(limit, int) or isinstance(limit, bool) or method is None:
        return None
    return limit if _reads_original_max_positions(method) else None


# -- pipelines -------------------------------------------------------------------------------------------------------
def chat_messages(item) -> list | None:
    """The messages of a chat as a text-generation pipeline item (transformers' internal ``Chat`` wrapper, or a plain
    list of ``{"role", "content"}`` dicts), or ``None`` when ``item`` is no chat."""
    from transformers.utils.chat_template_utils import Chat

    messages = item.messages if isinstance(item, Chat) else item
    if isinstance(messages, (list, tuple)) and messages and all(
            isinstance(m, dict) and "role" in m and "content" in m for m in messages):
        return list(messages)
    return None


def pipeline_chat(messages: list):
    """``messages`` wrapped as ``TextGenerationPipeline.preprocess`` expects a chat (the internal ``Chat`` class)."""
    from transformers.utils.chat_template_utils import Chat

    return Chat(messages)


# -- continuous batching ---------------------------------------------------------------------------------------------
def paged_attention_name() -> str:
    """The name continuous batching accepts for relay attention: ``paged|relay`` where transformers registers paged
    implementations under ``paged|`` names of their own (5.17), else a name that says "flash" (newer versions accept
    no other custom name; such a name builds no mask, which relay's paged attention does not need)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from .names import PAGED_NAMES

    return PAGED_NAMES[0] if "paged|sdpa" in ALL_ATTENTION_FUNCTIONS._global_mapping else PAGED_NAMES[1]


@cache
def decode_fast_path_available() -> bool:
    """Whether the installed transformers' continuous batching has the decode fast path (block tables into the
    paged cache, taken for flash-compatible kernels), found by looking for the function that turns it on."""
    try:
        from transformers.generation.continuous_batching import initialization
    except ImportError:
        return False
    return hasattr(initialization, "ensure_decode_fast_path_is_available")


def kernels_available() -> bool:
    """Whether transformers can load attention kernels through the ``kernels`` package (installed, at a version
    this transformers accepts)."""
    from transformers.utils import is_kernels_available

    return bool(is_kernels_available())


def set_config_attn(config, name: str) -> None:
    """Select ``name`` on ``config`` directly (``set_attn_implementation`` refuses a flash-like name it cannot
    import a kernel for)."""
    config._attn_implementation = name


@cache
def masks_skip_paged_cache() -> bool:
    """Whether transformers' mask creation returns no mask for a continuous-batching cache whatever the attention
    name (newer versions), read from its source."""
    import inspect

    from transformers import masking_utils

    return "PagedAttentionCache" in inspect.getsource(masking_utils._preprocess_mask_arguments)


def cached_continuous_manager(model):
    """The continuous-batching manager transformers keeps on ``model`` for a later call (``persistent_manager``)."""
    return getattr(model, "_cached_continuous_batching_manager", None)


def paged_update(cache, module, key, value, kwargs: dict):
    """Write this step's KV into transformers 5.17's paged cache and read back what ``read_index`` lists (in 5.17 the
    attention function does this; newer versions do it in the attention layer). ``[1, H_kv, N, D]`` each."""
    key, value = cache.update(key_states=key, value_states=value, layer_idx=module.layer_idx,
                              read_index=kwargs["read_index"], write_index=kwargs["write_index"])
    return key.transpose(0, 1).unsqueeze(0), value.transpose(0, 1).unsqueeze(0)


def is_paged_cache(obj) -> bool:
    from transformers.generation.continuous_batching.cache import PagedAttentionCache

    return isinstance(obj, PagedAttentionCache)


# -- serving -----------------------------------------------------------------------------------------------------
def serve_command():
    """transformers' ``transformers serve`` command class (its options are its constructor's parameters)."""
    from transformers.cli.serve import Serve

    return Serve


def serve_model_manager(serve):
    """The model manager a 5.17-style ``transformers serve`` instance loads its models through, in its own process."""
    return serve._model_manager


def serve_runs_engines() -> bool:
    """Whether ``transformers serve`` runs each model in an engine process of its own, loaded there through a pickled
    copy of the command's ``loader`` (newer versions), rather than in the server's process (5.17)."""
    try:
        from transformers.cli.serving.model_manager import EngineClient, ModelLoader  # noqa: F401
    except ImportError:
        return False
    return "self.loader" in inspect.getsource(serve_command().__init__)


# what transformers' ``Serve.run`` hands ``build_server``: a version whose server takes other parts is not one that
# ``run_engine_server`` can rebuild, and relay-hf serve refuses to start on it
_ENGINE_SERVER_PARTS = {"model_manager", "chat_handler", "completion_handler", "response_handler",
                        "transcription_handler", "systemone_handler", "enable_cors"}


def run_engine_server(serve, socket, engine_connection, add_routes) -> None:
    """Serve as transformers' ``Serve.run`` does where models run in engine processes, with ``add_routes(app,
    model_manager)`` called on the app before it serves (``Serve.run`` keeps its app in a local variable: there is no
    other way to add a route). ``RuntimeError`` at once where this transformers' server is built otherwise."""
    import uvicorn
    from transformers.cli.serving.chat_completion import ChatCompletionHandler
    from transformers.cli.serving.completion import CompletionHandler
    from transformers.cli.serving.model_manager import ModelManager
    from transformers.cli.serving.response import ResponseHandler
    from transformers.cli.serving.server import build_server
    from transformers.cli.serving.systemone import SystemOneHandler
    from transformers.cli.serving.transcription import TranscriptionHandler
    from transformers.cli.serving.utils import freeze_garbage_collector, set_serve_log_level

    parts = set(inspect.signature(build_server).parameters)
    if parts != _ENGINE_SERVER_PARTS:
        raise RuntimeError(f"relay-hf serve does not know this transformers' server (build_server takes "
                           f"{sorted(parts)}); serve with `transformers serve` instead")
    set_serve_log_level(serve.log_level, serve.enable_log_requests)
    model_manager = ModelManager(serve.loader, serve.generation_state, model_timeout=serve.model_timeout,
                                 force_model=serve.force_model, engine_connection=engine_connection)
    templated = dict(model_manager=model_manager, generation_state=serve.generation_state,
                     chat_template_kwargs=serve.chat_template_kwargs)
    app = build_server(
        model_manager, ChatCompletionHandler(**templated),
        completion_handler=CompletionHandler(model_manager=model_manager, generation_state=serve.generation_state),
        response_handler=ResponseHandler(**templated), transcription_handler=TranscriptionHandler(model_manager),
        systemone_handler=SystemOneHandler(**templated, decision_config=serve.decision_config),
        enable_cors=serve.enable_cors)
    add_routes(app, model_manager)

    async def stop_if_an_engine_died() -> None:
        if model_manager.is_dead:
            server.should_exit = True

    config = uvicorn.Config(app, host=serve.host, port=serve.port, log_level="info",
                            callback_notify=stop_if_an_engine_died, timeout_notify=5)
    server = uvicorn.Server(config)
    freeze_garbage_collector()
    server.run(sockets=None if socket is None else [socket])
    gc.unfreeze()
    if model_manager.is_dead:
        raise RuntimeError("An engine died (see the error above): stopping the server")


def running_engines(model_manager) -> dict:
    """``{model id: engine}`` of the models whose engine process runs now (newer ``transformers serve``)."""
    return {name: engine for name, engine in list(model_manager.engines.items()) if engine.process_running}


def call_in_engine(engine, function):
    """``function(model, processor)`` run in ``engine``'s process and its result, from outside any event loop (before
    the server serves); the engine delivers later results to the loop of its next request, as before."""
    import asyncio

    previous = engine._loop
    try:
        return asyncio.run(engine.submit(function))
    finally:
        engine._loop = previous
