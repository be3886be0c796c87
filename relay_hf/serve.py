"""``relay-hf serve MODEL [transformers serve's options]``: transformers' own OpenAI-compatible server with every
model it loads patched by ``relay_hf.patch``, plus ``GET /relay/stats``.

The server is ``transformers serve`` itself (same endpoints, same flags, same answers; ``--continuous-batching``
serves through relay's continuous batching, ``continuous.py``): ``RelayServe`` subclasses its command class and
takes its constructor's one seam, the moment the uvicorn server is assigned (the pinned model loaded, the app built,
nothing served yet), to patch what is loaded, to patch every model loaded later (this instance's model manager's
loader is wrapped) and to add the route. ``GET /relay/stats`` answers ``{"models": {name: {"patched": bool,
...relay_hf.stats fields}}}`` for the models loaded now (an unpinned model unloaded after ``--model-timeout`` takes
its counters with it).
"""

from __future__ import annotations

import threading
import warnings

import relay_hf

from ._compat import serve_command, serve_model_manager

_PATCH_LOCK = threading.Lock()


def _patched(model):
    """``model`` patched (once; a model relay declines keeps stock attention, as ``patch`` always does)."""
    with _PATCH_LOCK:
        if hasattr(model, "generate") and not relay_hf.is_patched(model):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", relay_hf.RelayFallbackWarning)
                relay_hf.patch(model)
    return model


def stats_of(manager) -> dict:
    """The ``GET /relay/stats`` body for the models ``manager`` holds now."""
    models = {}
    for name, timed in list(manager.loaded_models.items()):
        model = getattr(timed, "model", None)
        if model is not None:
            patched = relay_hf.is_patched(model)
            models[name] = {"patched": patched, **(relay_hf.stats(model).as_dict() if patched else {})}
    return {"models": models}


def _relay_serve_class():
    Serve = serve_command()

    class RelayServe(Serve):
        """``transformers serve`` whose models are patched by relay_hf, plus ``GET /relay/stats``."""

        __init__ = Serve.__init__  # the very same options (typer reads them from this signature)

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

    RelayServe.__doc__ = Serve.__doc__
    return RelayServe


def app():
    """The ``relay-hf`` command line (the factory transformers' own CLI is built with: same help and options)."""
    from huggingface_hub import typer_factory

    cli = typer_factory(help="relay_hf: RelayAttention for transformers")
    cli.command(name="serve", help=serve_command().__doc__)(_relay_serve_class())
    return cli


def main() -> None:
    app()()
