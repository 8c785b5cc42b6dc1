"""Hand-run benchmarks for flask-mail-outbox.

Run from the repository root with the project's virtualenv (``benchmarks/setup``
installs Postfix's ``smtp-sink`` and the ``bench`` extra)::

    python -m benchmarks list                 # the registered scenarios
    python -m benchmarks idle [--quick] ...   # one scenario (``--help`` for its options)
    python -m benchmarks all [--quick]        # every scenario, then the goals table

Each run prints a table per scenario, the goals table of issue 5 (from the
figures of that run only), and writes ``benchmarks/results/<name>-<UTC
time>.json`` (git-ignored). The machine these run on is small and shared, so
every figure is a median of several rounds or a percentile over many samples,
and comparisons are ratios taken within one run, never across runs.

Layout:

* ``_registry.py``: the scenario registry (``@scenario``); ``all`` runs them in
  import order, starting the ones that mostly wait (``idle``) first, in the
  background, and collecting them last;
* ``_harness.py``: what scenarios share: a throwaway PostgreSQL
  (``scripts/pg-cluster``), SMTP sinks in their own processes (Postfix's
  ``smtp-sink`` when installed, else ``sink.py``), worker subprocesses,
  statistics and the table/JSON output;
* ``sink.py``: the aiosmtpd sink process (``python -m benchmarks.sink``), also
  the one with a per-message delay;
* ``bench_app.py``: ``create_app()`` for the processes under test, configured
  from ``BENCH_*`` environment variables;
* the scenarios: ``idle.py`` (statements per minute), ``throughput.py``
  (aiosmtplib ceiling, Flask-Mail, the outbox end to end), ``enqueue.py``
  (``send()`` + commit vs a bare insert), ``history.py`` (1M retained rows),
  ``drain.py`` (1 vs 4 workers, 50 ms sink), ``backlog.py`` (deep per-key
  backlog; worker memory), ``request.py`` (request latency with a 1 s SMTP
  server), ``latency.py`` (commit to receipt while idle);
* ``goals.py``: the goals table from a run's results;
* ``profiles.py``: ``python -m benchmarks.profiles`` writes the pyinstrument
  profiles in ``profiles/`` that the README cites.
"""

RESULT_SCHEMA = 1
