"""The model cache: two processes starting at once on a fresh machine convert the registry model once."""

import threading
import time

from dflash import hub


def test_concurrent_first_use_converts_once(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path))
    calls = []

    def slow_convert(name, folder):
        calls.append(name)
        time.sleep(0.3)  # long enough for the other caller to arrive mid-conversion
        folder.mkdir(parents=True)
        (folder / "config.json").write_text("{}")
        (folder / "tokenizer_config.json").write_text("{}")

    monkeypatch.setattr(hub, "_convert", slow_convert)
    results = []
    workers = [threading.Thread(target=lambda: results.append(hub.resolve_registry_folder("smollm2-135m")))
               for _ in range(2)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert calls == ["smollm2-135m"]
    assert results == [tmp_path / "hf" / "smollm2-135m"] * 2


def test_converted_folder_is_reused_without_lock(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path))
    folder = tmp_path / "hf" / "smollm2-135m"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    (folder / "tokenizer_config.json").write_text("{}")
    monkeypatch.setattr(hub, "_convert", lambda *a: (_ for _ in ()).throw(AssertionError("converted again")))
    assert hub.resolve_registry_folder("smollm2-135m") == folder
    assert not (tmp_path / "hf" / "smollm2-135m.lock").exists()
