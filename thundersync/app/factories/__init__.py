"""The runtime objects a pipeline file builds by name (``factory = "policy-clock"``).

``registry`` maps each name to its factory; the real factories live in ``models``, ``training``,
``generators``, ``scheduling`` (admission) and ``warmup``. See :mod:`thundersync.app.factories.registry`.
"""

from __future__ import annotations

from thundersync.app.factories.registry import ALL_FACTORIES, FACTORIES, TEST_FACTORIES, TEST_PREFIX

__all__ = ["ALL_FACTORIES", "FACTORIES", "TEST_FACTORIES", "TEST_PREFIX"]
