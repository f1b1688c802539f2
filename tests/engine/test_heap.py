"""pagedkv.engine.heap: the start-up freeze, the full-collection threshold, the release."""

import gc

from pagedkv.engine.heap import FULL_COLLECTION_THRESHOLD, freeze_after_startup, release_frozen


def test_freeze_raises_the_default_full_collection_threshold_only():
    saved = gc.get_threshold()
    try:
        gc.set_threshold(700, 10, 10)
        freeze_after_startup()
        assert gc.get_threshold() == (700, 10, FULL_COLLECTION_THRESHOLD)
        assert gc.get_freeze_count() > 0
        gc.set_threshold(500, 5, 7)  # tuned by the application: kept
        freeze_after_startup()
        assert gc.get_threshold() == (500, 5, 7)
    finally:
        gc.set_threshold(*saved)


def test_release_frozen_collects_frozen_cycles():
    import weakref

    class Node:
        pass

    a, b = Node(), Node()
    a.other, b.other = b, a  # a cycle: only the cyclic GC frees it
    ref = weakref.ref(a)
    freeze_after_startup()
    del a, b
    gc.collect()
    assert ref() is not None  # frozen: never collected
    release_frozen()
    assert ref() is None


def test_disabled_gc_is_left_alone():
    saved = gc.get_threshold()
    gc.disable()
    try:
        n = gc.get_freeze_count()
        freeze_after_startup()
        release_frozen()
        assert gc.get_freeze_count() == n and gc.get_threshold() == saved
    finally:
        gc.enable()
