"""Learning from the journal: recorded runs as training data, and RLM runs as RL rollouts.

- :mod:`rlm.training.sources`: which runs to learn from (run ids of a journal, or the trials of
  an ``rlm eval`` sweep filtered by score, task, depth, profile, model, method).
- :mod:`rlm.training.chat`: the model calls of those runs as chat-format examples (the
  OpenAI fine-tuning shape, messages exactly as sent plus the reply), with provenance.
- :mod:`rlm.training.export`: ``rlm export --format chat``: sources -> one JSONL file; and
  ``--format profile`` (:mod:`rlm.training.profile`): a prompt profile whose worked examples
  are programs that solved a sweep's training split.
- :mod:`rlm.training.env`: an environment whose rollout is one journaled, sandboxed, capped
  RLM run scored by the eval task's scorer; :mod:`rlm.training.verifiers_env` adapts it to
  the ``verifiers`` library (optional extra ``[train]``).

See docs/training.md.
"""
