"""Imported by a zygote in tests/harness/test_zygote.py: a module that starts a thread when imported, which
makes forking its importer unsafe (the zygote must refuse, and its pool spawn its ranks)."""

import threading

_stop = threading.Event()
threading.Thread(target=_stop.wait, name="started-at-import", daemon=True).start()
