"""Registration in Gymnasium's registry, the module-prefixed form, plugins."""

import os
import subprocess
import sys
import textwrap
import warnings

import gymnasium as gym
import pytest

import rl2gem
from rl2gem.registry import ENTRY_POINT_GROUP, load_plugins

BUILTIN_IDS = ["rl2/GuessTheNumber-v0", "rl2/GuessTheNumber-Easy-v0", "rl2/GuessTheNumber-Hard-v0"]


def run_python(code: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
        cwd="/",
    )


@pytest.mark.parametrize("env_id", BUILTIN_IDS)
def test_builtin_ids_are_in_gymnasiums_registry(env_id):
    assert env_id in gym.registry and env_id in rl2gem.list_envs()
    env = gym.make(env_id)
    # no Gymnasium wrappers in between: the async API is reachable on what make returns
    assert isinstance(env, rl2gem.Env) and env.spec.id == env_id
    assert hasattr(env, "astep")
    env.close()


def test_list_envs_is_a_view_of_gymnasiums_registry():
    everything = rl2gem.list_envs()
    assert everything == rl2gem.list_envs(namespace=None) == sorted(everything)
    # the namespace filters: "rl2" is every id Gymnasium holds under rl2/
    assert rl2gem.list_envs("rl2") == sorted(k for k, s in gym.registry.items() if s.namespace == "rl2")
    assert set(BUILTIN_IDS) <= set(rl2gem.list_envs("rl2")) <= set(everything)
    # Gymnasium's own envs are in its registry, not in rl2gem's listing
    assert "CartPole-v1" in gym.registry and "CartPole-v1" not in everything
    assert rl2gem.list_envs("no-such-namespace") == []


def test_module_prefixed_make_without_prior_import():
    r = run_python(
        """
        import sys, gymnasium as gym
        assert "rl2gem" not in sys.modules
        env = gym.make("rl2gem:rl2/GuessTheNumber-v0")
        obs, info = env.reset(seed=0)
        print(type(env).__name__, info["seed"])
        """
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["GuessTheNumberEnv", "0"]


def test_unknown_id_gets_gymnasiums_did_you_mean():
    with pytest.raises(gym.error.Error, match="Did you mean: `GuessTheNumber`"):
        gym.make("rl2/GuesTheNumber-v0")
    with pytest.raises(gym.error.Error, match="rl2"):
        rl2gem.make("rl3/GuessTheNumber-v0")


def test_register_custom_env_from_any_module():
    rl2gem.register("testlab/Count-v0", "toy_envs:CountEnv", max_turns=3)
    try:
        env = rl2gem.make("testlab/Count-v0")
        assert env.max_turns == 3 and rl2gem.make("testlab/Count-v0", max_turns=5).max_turns == 5
        assert rl2gem.list_envs("testlab") == ["testlab/Count-v0"]
        assert "testlab/Count-v0" in rl2gem.list_envs() and "testlab/Count-v0" in rl2gem.list_envs(None)
        assert "testlab/Count-v0" not in rl2gem.list_envs("rl2")
    finally:
        del gym.registry["testlab/Count-v0"]


PLUGIN_PYPROJECT = """
[build-system]
requires = ["setuptools>=64"]
build-backend = "setuptools.build_meta"

[project]
name = "rl2gem-demo-plugin"
version = "0.0.1"

[tool.setuptools]
packages = ["rl2gem_demo_plugin", "rl2gem_demo_forgot"]

[project.entry-points."rl2gem.envs"]
demo = "rl2gem_demo_plugin:register_envs"
broken = "rl2gem_demo_plugin_missing:nothing"
forgot = "rl2gem_demo_forgot"
"""

FORGOT_MODULE = """
import rl2gem

def register_envs():  # never called: the entry point names the module
    rl2gem.register("demo/Forgotten-v0", "rl2gem_demo_plugin:Coin")
"""

PLUGIN_MODULE = """
import rl2gem

class Coin(rl2gem.Env):
    def _reset(self, options):
        self.side = "heads" if self.np_random.integers(2) else "tails"
        return "Heads or tails?", {}

    def _step(self, action):
        ok = action.strip().lower() == self.side
        return ("Right." if ok else "Wrong."), float(ok), True, False, {}

def register_envs():
    rl2gem.register("demo/Coin-v0", "rl2gem_demo_plugin:Coin")
"""


def test_entry_point_discovery_of_an_installed_package(tmp_path):
    src = tmp_path / "src"
    (src / "rl2gem_demo_plugin").mkdir(parents=True)
    (src / "pyproject.toml").write_text(PLUGIN_PYPROJECT)
    (src / "rl2gem_demo_plugin" / "__init__.py").write_text(PLUGIN_MODULE)
    (src / "rl2gem_demo_forgot").mkdir()
    (src / "rl2gem_demo_forgot" / "__init__.py").write_text(FORGOT_MODULE)
    target = tmp_path / "site"
    pip = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "--target",
            str(target),
            str(src),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert pip.returncode == 0, pip.stderr
    assert any(p.name.startswith("rl2gem_demo_plugin") and p.name.endswith(".dist-info") for p in target.iterdir())
    r = run_python(
        """
        import warnings
        warnings.simplefilter("always")
        import gymnasium as gym
        with warnings.catch_warnings(record=True) as caught:
            import rl2gem
        env = gym.make("demo/Coin-v0")
        from rl2gem.testing import check_env
        check_env("demo/Coin-v0")
        print("demo/Coin-v0" in rl2gem.list_envs("demo"))
        # listed with no argument, as a built-in env is, and not under rl2
        print("demo/Coin-v0" in rl2gem.list_envs(), "rl2/GuessTheNumber-v0" in rl2gem.list_envs(),
              "demo/Coin-v0" in rl2gem.list_envs("rl2"))
        print([str(w.message) for w in caught if "could not load env plugin" in str(w.message)])
        print([str(w.message) for w in caught if "registered no env" in str(w.message)])
        """,
        env={"PYTHONPATH": str(target)},
    )
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert lines[0] == "True"
    assert lines[1] == "True True False"
    # the broken entry point warns, naming itself, and does not break the import
    assert "'broken'" in lines[2] and "ModuleNotFoundError" in lines[2]
    # a module that only defines its registering function: one warning, for it alone, with the fix
    assert lines[3].count("registered no env") == 1 and "'forgot' = 'rl2gem_demo_forgot'" in lines[3]
    assert "e.g. 'rl2gem_demo_forgot:register_envs'" in lines[3]


def test_load_plugins_runs_once_unless_forced():
    assert ENTRY_POINT_GROUP == "rl2gem.envs"
    assert load_plugins() == []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert isinstance(load_plugins(force=True), list)
