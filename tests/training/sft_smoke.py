"""A few steps of supervised fine-tuning on an ``rlm export --format chat`` file, on the CPU.

Run by ``test_sft_smoke.py`` in a process of its own, in the environment of the ``[sft]`` extra
and without this checkout on its path: transformers imports Hugging Face's ``kernels``
distribution, whose import name is this project's ``kernels`` package (docs/training.md). The
trainer needs nothing of ours: only the exported file and the packaged model's GGUF.

What it does:

1. ``datasets.load_dataset("json", data_files=DATA)``: the export as it is;
2. the tokenizer (with its chat template) and the weights from the GGUF file, dequantized to
   float32 by transformers; with ``--layers N`` only the first N decoder layers are kept, so a
   step costs a fraction of the whole model's (the embeddings, final norm and head stay);
3. the mean loss over every example, then ``--epochs`` passes of TRL's ``SFTTrainer`` (batch 1,
   loss on every token of the chat template), then the mean loss again.

Prints one JSON object on the last line of stdout: ``rows``, ``columns``, ``layers``,
``parameters``, ``loss_before``, ``loss_after``, ``train_losses`` (one per step) and
``seconds`` (``load``, ``eval_before``, ``train``, ``eval_after``, ``total``).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", required=True, type=Path, help="the exported JSONL file")
    p.add_argument("--gguf", required=True, type=Path, help="the model's GGUF file")
    p.add_argument("--out", required=True, type=Path, help="the trainer's scratch directory")
    p.add_argument("--layers", type=int, default=0, help="keep the first N layers (0: all)")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--max-length", type=int, default=2048, help="tokens per example")
    return p.parse_args(argv)


def load_model(gguf: Path, layers: int):
    """``(tokenizer, model)`` from a GGUF file: the model dequantized to float32, cut to its
    first ``layers`` decoder layers when ``layers`` > 0."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # dequantize=True: plain float32 weights a trainer can update (packed GGUF blocks are
    # inference-only), and no look-up of a matmul kernel on the Hub
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, quantization_config=GgufConfig(dequantize=True))
    if 0 < layers < model.config.num_hidden_layers:
        model.model.layers = model.model.layers[:layers]
        model.config.num_hidden_layers = layers
        if getattr(model.config, "layer_types", None):
            model.config.layer_types = model.config.layer_types[:layers]
    return tokenizer, model


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    started = time.monotonic()
    import torch
    from datasets import load_dataset
    from trl import SFTConfig, SFTTrainer

    torch.manual_seed(0)
    data = load_dataset("json", data_files=str(args.data), split="train")
    tokenizer, model = load_model(args.gguf, args.layers)
    seconds = {"load": time.monotonic() - started}
    config = SFTConfig(
        output_dir=str(args.out), num_train_epochs=args.epochs, learning_rate=args.lr,
        per_device_train_batch_size=1, per_device_eval_batch_size=1, max_length=args.max_length,
        gradient_checkpointing=False,  # memory is not short here; recomputing costs time
        logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, seed=0,
        prediction_loss_only=True,  # the evaluation needs the loss only, not every logit
        bf16=False,  # float32: a CPU without bfloat16 units emulates it, several times slower
        disable_tqdm=True)
    trainer = SFTTrainer(model=model, args=config, train_dataset=data, eval_dataset=data,
                         processing_class=tokenizer)
    mark = time.monotonic()
    before = trainer.evaluate()["eval_loss"]
    seconds["eval_before"] = time.monotonic() - mark
    mark = time.monotonic()
    trainer.train()
    seconds["train"] = time.monotonic() - mark
    mark = time.monotonic()
    after = trainer.evaluate()["eval_loss"]
    seconds["eval_after"] = time.monotonic() - mark
    seconds["total"] = time.monotonic() - started
    print(json.dumps({
        "rows": data.num_rows, "columns": data.column_names,
        "layers": model.config.num_hidden_layers,
        "parameters": sum(p.numel() for p in model.parameters()),
        "loss_before": before, "loss_after": after,
        "train_losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
        "seconds": {k: round(v, 1) for k, v in seconds.items()},
    }))


if __name__ == "__main__":
    main()
