"""``relay-hf serve MODEL [transformers serve's options]``: transformers' own OpenAI-compatible server with every
model it loads patched by ``relay_hf.patch``, plus ``GET /relay/stats``.

The server is ``transformers serve`` itself (same endpoints, same flags, same answers; ``--continuous-batching``
serves through relay's continuous batching, ``continuous.py``). Where the model is patched depends on where
transformers runs it:

- newer versions run each model in an *engine process* of its own, loaded there through a pickled copy of the
  command's ``loader``: ``RelayServe`` wraps that loader (``RelayLoader``), so the model is patched in the process
  that runs it, and ``GET /relay/stats`` asks each running engine for its counters (``engine_stats``, through
  transformers' own ``EngineClient.submit``);
- transformers 5.17 runs the model in the server's process: ``RelayServe`` takes its constructor's one seam, the
  moment the uvicorn server is assigned (the pinned model loaded, nothing served yet), to patch what is loaded, to
  wrap the model manager's loader and to add the route.

A transformers whose server fits neither makes ``relay-hf serve`` fail at start with a message; it never serves an
unpatched model. ``GET /relay/stats`` answers ``{"models": {name: {"patched": bool, ...relay_hf.stats fields}}}`` for
the models loaded now (an unpinned model unloaded after ``--model-timeout`` takes its counters with it).
"""

from __future__ import annotations

import asyncio
import functools
import threading
import warnings

import relay_hf

from ._compat import (
    call_in_engine,
    run_engine_server,
    running_engines,
    serve_command,
    serve_model_manager,
    serve_runs_engines,
)
from .flash import local_kernels_entry

_PATCH_LOCK = threading.Lock()
STATS_HELP = "    GET  /relay/stats         — relay_hf's counters (relay_hf.stats) of each model loaded now."


def _patched(model):
    """``model`` patched (once; a model relay declines keeps stock attention, as ``patch`` always does)."""
    with _PATCH_LOCK:
        if hasattr(model, "generate") and not relay_hf.is_patched(model):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", relay_hf.RelayFallbackWarning)
                relay_hf.patch(model)
    return model


def model_stats(model) -> dict:
    """One model's entry of ``GET /relay/stats``."""
    patched = relay_hf.is_patched(model)
    return {"patched": patched, **(relay_hf.stats(model).as_dict() if patched else {})}


def engine_stats(model, processor) -> dict:
    """``model_stats``, run in a model's engine process (``EngineClient.submit`` calls it with the model and its
    processor): the counters live where the model runs."""
    return model_stats(model)


def stats_of(manager) -> dict:
    """The ``GET /relay/stats`` body for the models a 5.17-style ``manager`` holds now (in this process)."""
    models = {}
    for name, timed in list(manager.loaded_models.items()):
        model = getattr(timed, "model", None)
        if model is not None:
            models[name] = model_stats(model)
    return {"models": models}


class RelayLoader:
    """transformers serve's model loader, each model it loads patched. Pickled into every engine process (its state
    is the wrapped loader's), so the model is patched in the process that runs it; the rest of the loader's
    interface (configs, processors: what the server's own process loads) is the wrapped one's."""

    def __init__(self, loader):
        self.loader = loader

    def load_model_and_processor(self, *args, **kwargs):
        model, processor = self.loader.load_model_and_processor(*args, **kwargs)
        return _patched(model), processor

    def __getattr__(self, name):
        if name == "loader":  # not set yet (while unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.loader, name)


def _add_engine_stats_route(app, model_manager) -> None:
    @app.get("/relay/stats")
    async def relay_stats():
        # (asked through the engine's request queue: without continuous batching the answer waits for the
        # generation in progress, and it counts as a request for --model-timeout's idle timer)
        engines = running_engines(model_manager)
        answers = await asyncio.gather(*(engine.submit(engine_stats) for engine in engines.values()),
                                       return_exceptions=True)
        return {"models": {name: answer if isinstance(answer, dict) else {"error": str(answer)}
                           for name, answer in zip(engines, answers)}}


def _check_engine_patched(model_manager) -> None:
    """For a pinned model (its engine started with the server, or shared by several API servers, each of which
    asks): ``RuntimeError`` unless its engine process runs it patched, so a transformers that loads models some
    other way stops here instead of serving them unpatched."""
    for name, engine in running_engines(model_manager).items():
        if not call_in_engine(engine, engine_stats)["patched"]:
            raise RuntimeError(f"relay-hf serve: the engine process of {name} runs it unpatched (this transformers "
                               f"loads models without the command's loader); serve with `transformers serve`")


@functools.cache
def _relay_serve_class():
    """The command class, made once per process (``relay_hf.serve.RelayServe`` names it, so that an API server
    process of ``--api-server-count`` can unpickle its command)."""
    Serve = serve_command()
    engines = serve_runs_engines()

    class RelayServe(Serve):
        """``transformers serve`` whose models are patched by relay_hf, plus ``GET /relay/stats``."""

        __init__ = Serve.__init__  # the very same options (typer reads them from this signature)

        if engines:
            @property
            def loader(self):
                return self.__dict__["loader"]

            @loader.setter
            def loader(self, loader):
                self.__dict__["loader"] = loader if isinstance(loader, RelayLoader) else RelayLoader(loader)

            def run(self, socket=None, engine_connection=None) -> None:
                def add_routes(app, model_manager):
                    _check_engine_patched(model_manager)
                    _add_engine_stats_route(app, model_manager)

                run_engine_server(self, socket, engine_connection, add_routes)
        else:
            @property
            def server(self):
                return self.__dict__["server"]

            @server.setter
            def server(self, uvicorn_server):
                self._install_relay(uvicorn_server.config.app)
                self.__dict__["server"] = uvicorn_server

            def _install_relay(self, app) -> None:
                manager = serve_model_manager(self)
                for timed in list(manager.loaded_models.values()):  # a pinned model, loaded before this seam
                    if getattr(timed, "model", None) is not None:
                        _patched(timed.model)
                load = manager.load_model_and_processor

                def load_model_and_processor(*args, **kwargs):
                    model, processor = load(*args, **kwargs)
                    return _patched(model), processor

                manager.load_model_and_processor = load_model_and_processor  # this instance's loader, not the class's

                @app.get("/relay/stats")
                def relay_stats():
                    return stats_of(manager)

    RelayServe.__doc__ = help_text()
    RelayServe.__module__ = __name__
    RelayServe.__qualname__ = "RelayServe"
    return RelayServe


def help_text() -> str:
    """``transformers serve``'s help with relay_hf's route added to its list of endpoints."""
    doc = serve_command().__doc__ or ""
    lines = doc.rstrip("\n").split("\n")
    at = max((i for i, line in enumerate(lines) if line.lstrip().startswith(("GET ", "POST "))), default=None)
    if at is None:
        return doc + "\n" + STATS_HELP.strip() + "\n"
    return "\n".join([*lines[:at + 1], STATS_HELP, *lines[at + 1:]]) + "\n"


def kernel() -> None:
    """Print the LOCAL_KERNELS entry under which transformers loads relay's flash kernel by its id, e.g.
    ``LOCAL_KERNELS=$(relay-hf kernel) transformers serve MODEL --continuous-batching --attn-implementation
    relay-hf/relay-flash3``."""
    print(local_kernels_entry())


def app():
    """The ``relay-hf`` command line (the factory transformers' own CLI is built with: same help and options)."""
    from huggingface_hub import typer_factory

    cli = typer_factory(help="relay_hf: RelayAttention for transformers")
    cli.command(name="serve", help=help_text())(_relay_serve_class())
    cli.command(name="kernel", help=kernel.__doc__)(kernel)
    return cli


def __getattr__(name: str):
    if name == "RelayServe":
        return _relay_serve_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def main() -> None:
    app()()
