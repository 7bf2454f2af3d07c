"""The test run keeps only the XLA flags the running XLA accepts."""

from tests import xla_flags


def test_a_flag_xla_does_not_know_is_dropped_and_the_rest_kept(monkeypatch):
  monkeypatch.delenv(xla_flags._PROBED_ENV, raising=False)
  known, unknown = "--xla_backend_optimization_level=0", "--xla_no_such_flag_in_any_xla=true"
  assert xla_flags.accepted_flags((known, unknown)) == known
  # Kept for the run's other processes: a second call asks XLA nothing.
  monkeypatch.setattr(xla_flags, "_start_probe", None)
  assert xla_flags.accepted_flags((known, unknown)) == known
