"""The operator's side: the ``flask outbox`` commands, the dashboard, health and metrics.

They use the extension's public API and the core's read API
(:class:`~flask_mail_outbox.core.Reader`); ``OutboxMail`` adds them on top.
"""
