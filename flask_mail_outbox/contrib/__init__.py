"""Integrations with other libraries' processes: the task queues' executors.

``flask_mail_outbox.contrib.celery``, ``.rq`` and ``.dramatiq`` deliver committed
emails on the workers of a task queue the app already runs
(``OUTBOX_EXECUTOR``; see docs/executors/index.md). Each imports its engine, so each is
imported only by an app (or a worker) that chose it.
"""
