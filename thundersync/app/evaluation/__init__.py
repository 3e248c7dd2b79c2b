"""Evaluation runs: ``[eval]`` in a pipeline file, and ``thundersync eval FILE --checkpoint DIR``.

``runner``: :class:`Evaluation` (a graph of its own over the training graph's objects) and
:class:`EvalHook` (it runs after optimizer steps); ``check``: ``[eval]`` checked without building;
``scores``: the ``eval_*`` metrics keys, pass@k.
"""

from __future__ import annotations

from thundersync.app.evaluation.check import check_eval
from thundersync.app.evaluation.runner import EvalHook, Evaluation, attach_evaluation, evaluate_alone
from thundersync.app.evaluation.scores import eval_record, pass_at_k

__all__ = [
    "EvalHook",
    "Evaluation",
    "attach_evaluation",
    "check_eval",
    "eval_record",
    "evaluate_alone",
    "pass_at_k",
]
