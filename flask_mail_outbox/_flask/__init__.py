"""The Flask integration: the extension, per-app state, staging on the session, the sweep jobs.

It owns one :class:`~flask_mail_outbox.core.Outbox` per app and process
(:class:`.state.AppState`), turns its outcome callbacks into the app's
signals, and speaks Flask-Mail's surface (:mod:`.compat`). It imports the
core, the transports and message building; nothing below imports it.
"""
