"""One rank of ``tests/test_continuous_tp.py`` (launched by ``torch.distributed.run``, 2 ranks on CPU, gloo).

Loads the saved model with transformers' tensor parallelism (``tp_plan="auto"``), runs stock continuous batching
(``generate_batch``) on it, then patches it and runs it again; writes ``rank{RANK}.json`` into the output folder: both
runs' tokens, ``relay_hf.stats`` and the ``(query heads, KV heads)`` relay attention saw on this rank; then two plain
``generate`` calls on the patched sharded model (the second under the prompts the first kept): their new tokens and
``relay_last_decision`` (used, prefix_kept).

Usage: ``python -m torch.distributed.run --standalone --nproc_per_node 2 continuous_tp_worker.py MODEL_DIR OUT_DIR``,
with ``MODEL_DIR/requests.json`` holding ``{"inputs": [[token, ...], ...], "max_new_tokens": n}`` and the repository
root on ``PYTHONPATH``.
"""

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # relay's Triton kernels run on the CPU interpreter

import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402
from transformers.distributed import DistributedConfig  # noqa: E402

import relay_hf  # noqa: E402
from relay_hf import continuous  # noqa: E402
from tests.helpers import left_pad  # noqa: E402
from tests.test_continuous import cb_config, greedy, tokens  # noqa: E402


def main(model_dir: str, out_dir: str) -> None:
    spec = json.loads((Path(model_dir) / "requests.json").read_text())
    inputs, gen = spec["inputs"], greedy(spec["max_new_tokens"])
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="sdpa",
        distributed_config=DistributedConfig(tp_size=int(os.environ["WORLD_SIZE"]), tp_plan="auto")).eval()

    def run():
        results = model.generate_batch(inputs, generation_config=gen, continuous_batching_config=cb_config(),
                                       progress_bar=False)
        return tokens(results, len(inputs))

    stock = run()
    heads = set()
    attend = continuous.paged_relay_attention

    def spy(query, key, value, step, options):
        heads.add((query.shape[1], key.shape[1]))
        return attend(query, key, value, step, options)

    continuous.paged_relay_attention = spy
    relay_hf.patch(model, min_prefix_length=8)
    relay = run()
    cb_stats = relay_hf.stats(model).as_dict()
    torch.distributed.barrier()  # every rank's continuous-batching work done before the next collectives
    # plain generate after patch on the sharded model: twice, the second under the prompts the first one kept
    rows = [torch.tensor(p) for p in inputs]
    ids, mask = left_pad(rows)
    generated, decisions = [], []
    for _ in range(2):
        out = model.generate(ids, attention_mask=mask, generation_config=gen)
        generated.append(out[:, ids.shape[1]:].tolist())
        decisions.append([model.relay_last_decision.used, model.relay_last_decision.prefix_kept])
    report = dict(rank=torch.distributed.get_rank(), stock=stock, relay=relay, stats=cb_stats,
                  heads=sorted(heads), attn=model.config._attn_implementation, generate=generated,
                  decisions=decisions)
    (Path(out_dir) / f"rank{report['rank']}.json").write_text(json.dumps(report))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:3])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # the report is written: no interpreter teardown (gloo's threads can abort it)
