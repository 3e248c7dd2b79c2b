"""The factory registry lists real objects; the fakes of thundersync.testing appear only under test- names."""

from __future__ import annotations

from thundersync.app.factories.registry import FACTORIES, TEST_FACTORIES, TEST_PREFIX


def test_the_factory_registry_lists_real_objects_and_the_fakes_only_under_the_test_prefix() -> None:
    assert FACTORIES and all(not factory.__module__.startswith("thundersync.testing") for factory in FACTORIES.values())
    assert TEST_FACTORIES and all(name.startswith(TEST_PREFIX) for name in TEST_FACTORIES)
    assert all(factory.__module__ == "thundersync.testing" for factory in TEST_FACTORIES.values())
    assert not any(name.startswith(TEST_PREFIX) for name in FACTORIES)
