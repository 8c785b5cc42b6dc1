"""Benchmarks for flask-mail-outbox, run by hand at full size and by CI as a smoke test.

From the repository root, with the project's virtualenv (``pip install -e
'.[test,bench]'``)::

    python -m benchmarks list                 # the scenarios
    python -m benchmarks smoke                # every scenario at a tiny size (under a minute)
    python -m benchmarks drain [--n 5000 ...] # one scenario at full size (--help: its sizes)
    python -m benchmarks all                  # every scenario at full size

Each command prints a table per scenario and writes its figures to ``--json
PATH`` (default ``benchmarks/results/<command>-<UTC time>.json``, git-ignored).
PostgreSQL scenarios start a throwaway cluster with ``scripts/pg-cluster`` and
are skipped, with a line saying so, where no server binaries are installed.
The machine is small and shared, so figures are medians of rounds and
comparisons are ratios taken within one run.

The rule: public API only. The benchmarks use ``flask_mail_outbox`` and
``flask_mail_outbox.transports`` (their ``__all__``), the CLI, the dashboard's
pages, and SQL against the documented tables (``outbox_email``,
``outbox_attachment``, ``outbox_setting``, ``outbox_rate``); nothing whose name
starts with ``_`` under the package, so a refactor cannot break them silently.
``smoke`` fails when :mod:`benchmarks._public_api` finds such an import. The one
transport built by hand is :func:`benchmarks._harness.smtp_transport`.

Layout: ``_harness.py`` (PostgreSQL, sink and worker processes, tables and
statistics), ``bench_app.py`` (the app under test, from ``BENCH_*`` variables
in child processes), ``sink.py`` (the aiosmtpd sink, with a per-message delay
and an optional quota), one module per scenario (``enqueue``, ``transport``,
``drain``, ``limits``, ``request``, ``history``, ``idle``, ``bounces``, ...), and ``peers/`` (the
outbox against Flask-Mail, Celery and django-post-office; its README says how
to install them).
"""
