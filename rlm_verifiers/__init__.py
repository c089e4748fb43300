"""The ``verifiers`` plugin id of this project's RL environment: ``vf-eval rlm-verifiers``.

verifiers 0.4 imports a taskset by a top-level module name (a dotted id is not found), so
this package only re-exports :mod:`rlm.training.verifiers_env`'s taskset and harness.
Needs the ``train`` extra; see docs/training.md.
"""
from rlm.training.verifiers_env import RLMHarness, RLMTaskset

__all__ = ["RLMTaskset", "RLMHarness"]
