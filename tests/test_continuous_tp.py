"""relay_hf.continuous under tensor parallelism: continuous batching on a patched model sharded by transformers'
``tp_plan="auto"`` (2 ranks on CPU, gloo, launched by ``torch.distributed.run``) gives the tokens of stock continuous
batching under the same sharding and of non-sharded ``generate``; every rank relays its own KV heads, planning each
step from the batch state the driver broadcasts (relay adds no communication)."""

import json
import os
import signal
import subprocess
import sys

import pytest
import torch

from tests.helpers import REPO, left_pad, tiny_model
from tests.test_continuous import greedy, requests_under

RANKS = 2
WORKER = REPO / "tests" / "continuous_tp_worker.py"

pytestmark = pytest.mark.skipif(not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
                                reason="needs torch.distributed with the gloo backend")


def launch(model_dir, out_dir, timeout=240, tries=2):
    """Run the worker on ``RANKS`` CPU ranks; its output on failure (a hung launch is killed with its ranks). A launch
    whose ranks were killed by a signal before any wrote its report (gloo's process group can abort a rank on a
    loaded machine) is run once more; any other failure fails the test."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={RANKS}", str(WORKER),
           str(model_dir), str(out_dir)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"the {RANKS} ranks did not finish in {timeout} s:\n{out[-6000:]}")
    aborted = "exitcode: -" in out and not any(out_dir.glob("rank*.json"))
    if proc.returncode != 0 and aborted and tries > 1:
        return launch(model_dir, out_dir, timeout, tries - 1)
    assert proc.returncode == 0, out[-6000:]


def test_continuous_batching_under_tensor_parallelism_gives_stock_tokens_and_relays_on_every_rank(tmp_path):
    model = tiny_model("qwen2", seed=3, initializer_range=0.3)  # 8 query heads, 2 KV heads: 4 and 1 per rank
    inputs = requests_under([(48, 4), (40, 3)], seed=8)  # whole 16-token pages under each system prompt
    new = 12
    want = [model.generate(torch.tensor([p]), generation_config=greedy(new))[0, len(p):].tolist() for p in inputs]
    assert all(len(t) == new for t in want) and len({tuple(t) for t in want}) == len(inputs)
    ids, mask = left_pad([torch.tensor(p) for p in inputs])
    batched = type(model).generate(model, ids, attention_mask=mask, generation_config=greedy(new))[:, ids.shape[1]:]
    model.save_pretrained(tmp_path)
    (tmp_path / "requests.json").write_text(json.dumps({"inputs": inputs, "max_new_tokens": new}))

    launch(tmp_path, tmp_path)

    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(RANKS)]
    assert [r["rank"] for r in ranks] == list(range(RANKS))
    for r in ranks:
        assert r["stock"] == want, f"stock continuous batching under TP, rank {r['rank']}"
        assert r["relay"] == want, f"relay continuous batching under TP, rank {r['rank']}"
        assert r["heads"] == [[4, 1]]  # relay attention ran on this rank's shard of the heads, and only on it
        assert r["attn"] == "relay"
        assert r["generate"] == [batched.tolist()] * 2, f"patched generate under TP, rank {r['rank']}"
        assert all(used for used, _ in r["decisions"]) and r["decisions"][1][1] > 0  # the second kept the prompts
    driver = ranks[0]["stats"]
    assert driver["relay_steps"] > 0 and driver["relay_rows"] > driver["relay_steps"]
    assert driver["kv_bytes_not_reread"] > 0
    assert ranks[1]["stats"] == driver  # every rank planned the same steps from the broadcast batch state
