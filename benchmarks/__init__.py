"""Hand-run benchmarks for flask-mail-outbox.

Run from the repository root with the project's virtualenv::

    python -m benchmarks list                 # the registered scenarios
    python -m benchmarks idle [--quick] ...   # one scenario (``--help`` for its options)
    python -m benchmarks all [--quick]        # every scenario, one after the other

Each run prints a table and writes ``benchmarks/results/<name>-<UTC time>.json``
(git-ignored). The machine these run on is small and shared, so every figure
is a median of several rounds or a percentile over many samples, and
comparisons are ratios taken within one run, never across runs.

Layout:

* ``_registry.py``: the scenario registry (``@scenario``), one entry per module;
* ``_harness.py``: what scenarios share: a throwaway PostgreSQL
  (``scripts/pg-cluster``), SMTP sinks in their own processes, worker
  subprocesses, statistics and the table/JSON output;
* ``sink.py``: the aiosmtpd sink process (``python -m benchmarks.sink``);
  Postfix's ``smtp-sink`` is used instead for plain throughput when it exists;
* ``bench_app.py``: ``create_app()`` for the processes under test, configured
  from ``BENCH_*`` environment variables;
* ``idle.py``, ``drain.py``, ``latency.py``: the scenarios.
"""

RESULT_SCHEMA = 1
