"""The persistent compilation cache: where it lives, how it turns off, and
that a second start of the same engine compiles nothing new."""

import json
import os
import pathlib
import subprocess
import sys

import jax
import pytest

from paged_jax import compilation_cache

ROOT = pathlib.Path(__file__).resolve().parent.parent
# Starts a tiny-model engine and serves one request (or only builds the
# engine), counting JAX's compilation-cache events from the engine's
# creation on; prints them as JSON with the tokens and JAX's cache folder.
START_ENGINE = """
import collections, json, sys
import jax
import paged_jax as pj
from paged_jax.models import load_tiny

model = load_tiny()
counts = collections.Counter()
jax.monitoring.register_event_listener(lambda event, **_: counts.update([event]))
cfg = pj.CacheConfig(
  block_size=4, num_gpu_blocks=8, num_cpu_blocks=0, max_seqs=1, max_blocks_per_seq=4
)
engine = pj.LLMEngine(model, None, cfg, num_decode_steps=2, max_num_batched_tokens=8,
                      max_logprobs=0, max_beam_width=1)
tokens = []
if sys.argv[1] == "serve":
  engine.add_request("0", [1, 2, 3], pj.SamplingParams(max_tokens=3))
  while engine.has_unfinished_requests():
    tokens = [out.outputs[0].token_ids for out in engine.step()] or tokens
prefix = "/jax/compilation_cache/"
print(json.dumps({
  "requests": counts[prefix + "compile_requests_use_cache"],
  "hits": counts[prefix + "cache_hits"],
  "writes": counts[prefix + "cache_misses"],
  "cache_dir": jax.config.jax_compilation_cache_dir,
  "tokens": tokens,
}))
"""


def _start_engine(env_changes: dict, mode: str = "serve") -> dict:
  env = {
    key: value
    for key, value in os.environ.items()
    if key not in (compilation_cache.CACHE_DIR_ENV, "JAX_COMPILATION_CACHE_DIR")
  }
  env.update(JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
  env.update(env_changes)
  result = subprocess.run(
    [sys.executable, "-c", START_ENGINE, mode],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert result.returncode == 0, result.stderr[-4000:]
  return json.loads(result.stdout)


# Three engine starts, each a new Python process (only a new process shows
# what a restart reads back), about 30 s: `slow`, run by the full suite, like
# the other tests of whole processes (notebooks, two-process meshes). CI keeps
# the tests below of where the cache lives and how it turns off.
@pytest.mark.slow
def test_a_second_start_reads_every_program_back_and_the_switch_turns_it_off(tmp_path):
  xdg = tmp_path / "xdg"
  default = xdg / "paged_jax" / "jax"
  first = _start_engine({"XDG_CACHE_HOME": str(xdg)})
  assert first["cache_dir"] == str(default)
  assert first["requests"] > 0 and first["hits"] == 0
  assert first["writes"] == first["requests"]  # every program, however small
  entries = sorted(os.listdir(default))
  assert len(entries) >= first["writes"]
  # The same engine in a new process, the folder named explicitly this time.
  second = _start_engine({compilation_cache.CACHE_DIR_ENV: str(default)})
  assert second["cache_dir"] == str(default)
  assert second["requests"] == first["requests"]
  assert second["hits"] == second["requests"] and second["writes"] == 0
  assert second["tokens"] == first["tokens"] and len(first["tokens"][0]) == 3
  assert sorted(os.listdir(default)) == entries
  # Switched off, the engine neither reads the full folder nor writes to it.
  off = _start_engine({compilation_cache.CACHE_DIR_ENV: "", "XDG_CACHE_HOME": str(xdg)}, "build")
  assert off["cache_dir"] is None
  assert off["requests"] > 0 and off["hits"] == 0 and off["writes"] == 0
  assert sorted(os.listdir(default)) == entries


def test_the_cache_folder_follows_the_environment(tmp_path, monkeypatch):
  home = pathlib.Path.home() / ".cache" / "paged_jax" / "jax"
  assert compilation_cache.default_cache_dir({}) == str(home)
  assert compilation_cache.default_cache_dir({"XDG_CACHE_HOME": "/x"}) == "/x/paged_jax/jax"
  env = {"XDG_CACHE_HOME": "/x"}
  assert compilation_cache.resolve_cache_dir(None, env) == "/x/paged_jax/jax"
  assert compilation_cache.resolve_cache_dir(None, {**env, "PAGED_JAX_CACHE_DIR": "/y"}) == "/y"
  assert compilation_cache.resolve_cache_dir(None, {**env, "PAGED_JAX_CACHE_DIR": ""}) is None
  assert compilation_cache.resolve_cache_dir("/z", {"PAGED_JAX_CACHE_DIR": "/y"}) == "/z"
  assert compilation_cache.resolve_cache_dir("", {"PAGED_JAX_CACHE_DIR": "/y"}) is None
  monkeypatch.chdir(tmp_path)
  assert compilation_cache.resolve_cache_dir("rel", {}) == str(tmp_path / "rel")


SETTINGS = (
  "jax_compilation_cache_dir",
  "jax_persistent_cache_min_compile_time_secs",
  "jax_persistent_cache_min_entry_size_bytes",
)


@pytest.fixture
def unsettled(monkeypatch):
  """`enable` as in a process that never called it, JAX's settings restored
  after (this process's cache, opened at its first compile, stays as it is)."""
  saved = {name: getattr(jax.config, name) for name in SETTINGS}
  monkeypatch.setattr(compilation_cache, "_settled", compilation_cache._UNSET)
  monkeypatch.delenv(compilation_cache.CACHE_DIR_ENV, raising=False)
  jax.config.update("jax_compilation_cache_dir", None)
  yield
  for name, value in saved.items():
    jax.config.update(name, value)


def _settings() -> tuple:
  return tuple(getattr(jax.config, name) for name in SETTINGS)


def test_enable_caches_small_programs_once_per_process(unsettled, tmp_path, monkeypatch):
  monkeypatch.setenv(compilation_cache.CACHE_DIR_ENV, str(tmp_path))
  assert compilation_cache.enable() == str(tmp_path)
  assert _settings() == (str(tmp_path), 0.0, -1)
  monkeypatch.setenv(compilation_cache.CACHE_DIR_ENV, str(tmp_path / "elsewhere"))
  assert compilation_cache.enable() == str(tmp_path)  # settled
  assert compilation_cache.enable(str(tmp_path)) == str(tmp_path)
  with pytest.raises(ValueError, match="already settled .*must come before the first engine"):
    compilation_cache.enable(str(tmp_path / "elsewhere"))
  with pytest.raises(ValueError, match="already settled"):
    compilation_cache.enable("")


def test_enable_off_sets_nothing(unsettled, monkeypatch):
  before = _settings()
  monkeypatch.setenv(compilation_cache.CACHE_DIR_ENV, "")
  assert compilation_cache.enable() is None
  assert compilation_cache.enable() is None
  assert _settings() == before
  with pytest.raises(ValueError, match=r"already settled \(off\)"):
    compilation_cache.enable("/somewhere")


def test_enable_keeps_the_users_own_cache_and_thresholds(unsettled, tmp_path):
  jax.config.update("jax_compilation_cache_dir", str(tmp_path / "mine"))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 5.0)
  before = _settings()
  assert compilation_cache.enable(str(tmp_path / "ours")) == str(tmp_path / "mine")
  assert _settings() == before
  assert not (tmp_path / "ours").exists()
