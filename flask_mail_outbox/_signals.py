"""Blinker signals, sent with the Flask app as sender.

* ``email_queued(app, email_id=...)``: after the transaction that queued it committed.
* ``email_sent(app, email_id=..., message_id=..., message=DeliveredMessage,
  created_at=datetime)``: ``created_at`` is when ``send()`` queued it (naive UTC).
* ``email_failed(app, email_id=..., message_id=..., error=TransportError)``:
  terminal failures only (the row is ``failed``).
"""

from __future__ import annotations

from blinker import Namespace

_signals = Namespace()

email_queued = _signals.signal("email-queued")
email_sent = _signals.signal("email-sent")
email_failed = _signals.signal("email-failed")
