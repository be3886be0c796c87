"""``relay-hf serve`` against stock ``transformers serve``: two real servers (subprocesses on loopback ports) serve the
embedded SmolLM2 with continuous batching, and every test sends both the same requests.

Concurrent chat completions under one system prompt (streaming and not) answer the same on both, relay reading the
shared blocks once (``GET /relay/stats``); a client that drops a stream mid-way and a malformed request leave both
servers serving, with the same status codes and the same answers afterwards.
"""

from __future__ import annotations

import copy
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import relay_hf

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

# A paged cache small enough to allocate at once (without explicit sizes transformers sizes it from the free memory),
# blocks short enough that requests under the ~820-token system prompt share whole blocks, and a batch budget that
# prefills such a prompt in a few chunks, so later requests find the first one's blocks complete.
CB_OPTIONS = ["--continuous-batching", "--device", "cpu", "--cb-block-size", "64", "--cb-num-blocks", "96",
              "--cb-max-batch-tokens", "256"]
STARTUP_S = 120
REQUEST_S = 120
QUESTIONS = ["What is your name?", "How do I reset my password?", "Which plans do you offer?", "Can I get a refund?"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One ``serve`` subprocess on a loopback port; its output goes to a file (read back when it fails)."""

    def __init__(self, name: str, module: str, model_dir: str, log_dir, env: dict, extra: tuple = ()):
        self.name, self.model = name, model_dir
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"{name}.log"
        self._log = open(self.log_path, "wb")
        self.process = subprocess.Popen(
            [sys.executable, "-m", module, "serve", model_dir, *CB_OPTIONS, *extra, "--host", "127.0.0.1",
             "--port", str(self.port)],
            stdout=self._log, stderr=subprocess.STDOUT, env=env)

    def log_tail(self, chars: int = 4000) -> str:
        self._log.flush()
        return self.log_path.read_bytes()[-chars:].decode(errors="replace")

    def wait_healthy(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                pytest.fail(f"{self.name} server exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                if request(self, "GET", "/health", timeout=5)[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.25)
        pytest.fail(f"{self.name} server not healthy after {STARTUP_S} s:\n{self.log_tail()}")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(15)
        self._log.close()

    def client(self):
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", timeout=REQUEST_S, max_retries=0)


def request(server: Server, method: str, path: str, body: bytes | None = None, timeout: float = REQUEST_S):
    """``(status, body text)`` of one plain HTTP request (error statuses returned, not raised)."""
    req = urllib.request.Request(server.url + path, data=body, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


@pytest.fixture(scope="module")
def servers(smollm2, tmp_path_factory):
    """``(stock, relay)``: both servers up, serving the embedded SmolLM2 (fp32, saved with its chat template)."""
    model, tokenizer = smollm2
    model_dir = tmp_path_factory.mktemp("smollm2")
    config = copy.deepcopy(model.config)
    del config.quantization_config  # the weights are dequantised: saved as a plain fp32 checkpoint
    with torch.device("meta"):
        plain = type(model)(config)
    plain.load_state_dict(model.state_dict(), assign=True)  # the session model's tensors, not copies
    plain.generation_config = model.generation_config
    plain.save_pretrained(model_dir)
    del plain
    tokenizer.save_pretrained(model_dir)
    assert tokenizer.chat_template
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(HF_HUB_OFFLINE="1", HF_HUB_DISABLE_UPDATE_CHECK="1", TOKENIZERS_PARALLELISM="false",
               OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 2) // 2)))  # two servers share the cores
    logs = tmp_path_factory.mktemp("serve_logs")
    _SERVED.update(model_dir=str(model_dir), env=env, logs=logs)
    started = []
    try:
        for name, module in (("stock", "transformers.cli.transformers"), ("relay", "relay_hf")):
            started.append(Server(name, module, str(model_dir), logs, env))
        deadline = time.monotonic() + STARTUP_S
        for server in started:
            server.wait_healthy(deadline)
        yield tuple(started)
    finally:
        for server in started:
            server.stop()


_SERVED: dict = {}  # the saved model, environment and log directory of ``servers`` (for ``kernel_server``)


def _messages(system_prompt: str, question: str) -> list[dict]:
    return [{"role": "system", "content": system_prompt}, {"role": "user", "content": question}]


def _chat(server: Server, messages: list[dict], stream: bool, max_tokens: int = 12) -> str:
    kwargs = dict(model=server.model, messages=messages, max_tokens=max_tokens, temperature=0)
    client = server.client()
    try:
        if not stream:
            return client.chat.completions.create(**kwargs).choices[0].message.content
        chunks = client.chat.completions.create(**kwargs, stream=True)
        return "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    finally:
        client.close()


def _concurrent_answers(server: Server, system_prompt: str) -> list[str]:
    """The answers to ``QUESTIONS`` sent at once (the first two streaming)."""
    with ThreadPoolExecutor(len(QUESTIONS)) as pool:
        futures = [pool.submit(_chat, server, _messages(system_prompt, q), i < 2) for i, q in enumerate(QUESTIONS)]
        return [f.result(timeout=2 * REQUEST_S) for f in futures]


def _stats(server: Server) -> dict:
    status, body = request(server, "GET", "/relay/stats")
    assert status == 200, body
    return json.loads(body)["models"]


@pytest.fixture(scope="module")
def concurrent(servers, system_prompt):
    """The concurrent answers of both servers, and relay's stats before and after its batch (the later tests take
    this fixture too, so that it runs first and its stats count its batch alone)."""
    stock, relay = servers
    before = _stats(relay)
    with ThreadPoolExecutor(2) as pool:  # both servers at once: the two batches overlap in time, not in answers
        stock_answers, relay_answers = pool.map(_concurrent_answers, (stock, relay), (system_prompt, system_prompt))
    return stock_answers, relay_answers, before, _stats(relay)


def test_concurrent_chat_matches_stock(concurrent):
    stock_answers, relay_answers, _, _ = concurrent
    assert len(relay_answers) == len(QUESTIONS) and all(relay_answers), relay_answers
    assert len(set(relay_answers)) > 1  # different questions, different answers: the rows were not mixed up
    assert relay_answers == stock_answers


def test_relay_stats_count_shared_blocks(servers, concurrent):
    stock, relay = servers
    _, _, before, after = concurrent
    assert len(after) == 1
    (name, counters), = after.items()
    assert relay.model in name  # 5.17 names a local directory "<dir>@main"
    assert counters["patched"] is True
    assert set(counters) >= {"relay_steps", "relay_rows", "kv_bytes_not_reread", "prefix_hits",
                             "prefill_tokens_saved", "stock_calls"}
    assert before[name]["patched"] is True  # the pinned model is patched before the first request
    assert before[name]["relay_steps"] == 0
    assert counters["relay_steps"] > 0  # decode steps of overlapping requests read the prompt's blocks once
    assert counters["relay_rows"] >= 2 * counters["relay_steps"]
    assert counters["kv_bytes_not_reread"] > 0
    assert request(stock, "GET", "/relay/stats")[0] == 404


def test_dropped_stream_leaves_relay_serving(servers, concurrent, system_prompt):
    """A client reads a few chunks of a long stream and hangs up; the next request is answered as stock answers it."""
    stock, relay = servers
    client = relay.client()
    try:
        stream = client.chat.completions.create(
            model=relay.model, messages=_messages(system_prompt, "Describe every plan you offer in detail."),
            max_tokens=400, temperature=0, stream=True)
        received = []
        for chunk in stream:
            received.append(chunk)
            if len(received) == 3:
                break
        stream.close()
    finally:
        client.close()
    assert len(received) == 3
    messages = _messages(system_prompt, "Do you have a mobile app?")
    answer = _chat(relay, messages, stream=False)
    assert answer and answer == _chat(stock, messages, stream=False)
    assert request(relay, "GET", "/health")[0] == 200


@pytest.mark.parametrize("body", [b"{not json", json.dumps({"max_tokens": 4}).encode()],
                         ids=["invalid-json", "no-messages"])
def test_bad_request_same_status(servers, concurrent, system_prompt, body):
    (stock_status, _), (relay_status, _) = (request(s, "POST", "/v1/chat/completions", body) for s in servers)
    assert 400 <= relay_status < 600
    assert relay_status == stock_status
    messages = _messages(system_prompt, "What is your name?")
    answers = [_chat(s, messages, stream=True) for s in servers]
    assert answers[0] and answers[0] == answers[1]
    assert all(request(s, "GET", "/health")[0] == 200 for s in servers)


@pytest.fixture(scope="module")
def kernel_server(servers, concurrent):
    """Stock ``transformers serve`` with relay's flash kernel as its attention (``--attn-implementation``), found
    through ``LOCAL_KERNELS`` as ``relay-hf kernel`` prints it (in the engine process too, where there is one)."""
    from relay_hf import _compat
    from relay_hf.flash import KERNEL_ID

    if not _compat.kernels_available():
        pytest.skip("transformers loads attention kernels through the kernels package, not installed here")
    entry = subprocess.run([sys.executable, "-m", "relay_hf", "kernel"], capture_output=True, text=True,
                           timeout=120, check=True).stdout.strip()
    env = dict(_SERVED["env"], LOCAL_KERNELS=entry)
    server = Server("kernel", "transformers.cli.transformers", _SERVED["model_dir"], _SERVED["logs"], env,
                    extra=("--attn-implementation", KERNEL_ID))
    try:
        server.wait_healthy(time.monotonic() + STARTUP_S)
        yield server
    finally:
        server.stop()


def test_stock_serve_with_relays_kernel_id_answers_like_stock(servers, concurrent, kernel_server, system_prompt):
    stock_answers = concurrent[0]
    assert _concurrent_answers(kernel_server, system_prompt) == stock_answers
    assert request(kernel_server, "GET", "/health")[0] == 200


def test_help_lists_the_stats_route():
    out = subprocess.run([sys.executable, "-m", "relay_hf", "serve", "--help"], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "COLUMNS": "200"})
    assert out.returncode == 0, out.stderr
    assert "/relay/stats" in out.stdout and "/v1/chat/completions" in out.stdout


def test_a_server_relay_cannot_rebuild_fails_at_start(monkeypatch):
    """Where models run in engine processes, a transformers whose server takes other parts than relay-hf serve
    knows refuses to start (it would otherwise serve without relay's route or patch)."""
    from relay_hf import _compat

    if not _compat.serve_runs_engines():
        pytest.skip("this transformers runs the model in the server's process")
    from transformers.cli.serving import server

    def build_server(model_manager, chat_handler, another_handler=None):
        raise AssertionError("not reached")

    monkeypatch.setattr(server, "build_server", build_server)
    with pytest.raises(RuntimeError, match="does not know this transformers' server"):
        _compat.run_engine_server(object(), None, None, lambda app, manager: None)


class TinyLoader:
    """A model loader as transformers serve's: a tiny random model and a stand-in processor."""

    def load_model_and_processor(self, model_id, on_progress=None):
        from tests.helpers import tiny_model

        return tiny_model("llama"), f"processor of {model_id}"

    def load_config(self, model_id):
        return f"config of {model_id}"


def test_the_loader_patches_what_it_loads_and_travels_to_an_engine_process():
    """The wrapped loader survives pickling (an engine process is spawned with a copy) and patches every model it
    loads; configs and processors come from the wrapped loader."""
    import pickle

    from relay_hf.serve import RelayLoader

    loader = pickle.loads(pickle.dumps(RelayLoader(TinyLoader())))
    model, processor = loader.load_model_and_processor("m")
    assert relay_hf.is_patched(model) and processor == "processor of m"
    assert loader.load_config("m") == "config of m"
    relay_hf.unpatch(model)


def _load(server: Server, system_prompt: str) -> list[str | None]:
    """32 chats at once under the system prompt (questions cycled, half of them streaming); every fourth is a stream
    the client drops after its first chunk (``None`` in the result)."""
    def one(i: int) -> str | None:
        messages = _messages(system_prompt, QUESTIONS[i % len(QUESTIONS)])
        if i % 4 != 3:
            return _chat(server, messages, stream=i % 2 == 0)
        client = server.client()
        try:
            stream = client.chat.completions.create(model=server.model, messages=messages, max_tokens=12,
                                                    temperature=0, stream=True)
            next(iter(stream))
            stream.close()
        finally:
            client.close()
        return None

    with ThreadPoolExecutor(32) as pool:
        return [f.result(timeout=4 * REQUEST_S) for f in [pool.submit(one, i) for i in range(32)]]


def _check_load(server: Server, system_prompt: str, stock_answers: list[str]) -> None:
    got = _load(server, system_prompt)
    assert got == [None if i % 4 == 3 else stock_answers[i % len(QUESTIONS)] for i in range(32)]
    assert request(server, "GET", "/health")[0] == 200
    assert _chat(server, _messages(system_prompt, QUESTIONS[0]), stream=True) == stock_answers[0]


@pytest.mark.long  # 32 concurrent chats: about half a minute on two cores
def test_relay_under_load_with_dropped_streams_answers_as_stock(servers, concurrent, system_prompt):
    _check_load(servers[1], system_prompt, concurrent[0])


@pytest.mark.long
def test_the_kernel_under_load_with_dropped_streams_answers_as_stock(kernel_server, concurrent, system_prompt):
    _check_load(kernel_server, system_prompt, concurrent[0])
