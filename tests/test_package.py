"""Packaging: the package-dir mapping, lazy GPU imports."""

import subprocess
import sys
import textwrap
import zipfile

ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]


def test_import_needs_no_gpu_packages():
    code = textwrap.dedent(
        """
        import sys, importlib.abc
        BLOCKED = {"flash_attn", "ring_flash_attn", "sglang"}

        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                if name.split(".")[0] in BLOCKED:
                    raise ImportError(f"{name} is not installed (blocked by the test)")

        sys.meta_path.insert(0, Block())
        import gymnasium as gym
        import rl2gem
        env = gym.make("rl2/GuessTheNumber-v0")
        env.reset(seed=0)
        print(sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED | {"torch", "transformers"}))
        """
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd="/")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"  # nor does import rl2gem pull in torch or transformers


def test_wheel_maps_envs_and_trainers_under_rl2gem(tmp_path):
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path),
            str(ROOT),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    (wheel,) = tmp_path.glob("rl2gem-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for path in (
        "rl2gem/__init__.py",
        "rl2gem/core.py",
        "rl2gem/envs/__init__.py",
        "rl2gem/envs/games/guess_the_number.py",
        "rl2gem/trainers/__init__.py",
        "rl2gem/rewards/math.py",
        "rl2gem/envs/games/wordle.py",
        "rl2gem/parallel/fsdp.py",
        "rl2gem/parallel/packing.py",
        "rl2gem/tools/python.py",
        "rl2gem/tools/_sandbox_boot.py",
        "rl2gem/envs/bfcl.py",
        "rl2gem/algorithms/losses.py",
        "rl2gem/rollout/engines/embedded.py",
        "rl2gem/trainers/ppo.py",
        "rl2gem/trainers/config/ppo.yaml",
    ):
        assert path in names, path
    assert not any(n.startswith(("envs/", "trainers/", "tests/")) for n in names)
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "rl2gem-evaluate = rl2gem.evaluate:main" in zipfile.ZipFile(wheel).read(entry_points).decode()
