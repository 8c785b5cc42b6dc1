"""Blinker signals, sent with the Flask app as sender.

* ``email_queued(app, email_id=...)``: after the transaction that queued it committed.
* ``email_sent(app, email_id=..., message_id=..., message=DeliveredMessage,
  created_at=datetime)``: ``created_at`` is when ``send()`` queued it (naive UTC).
* ``email_failed(app, email_id=..., message_id=..., error=TransportError)``:
  terminal failures only (the row is ``failed``).
* ``email_event(app, event=DeliveryEvent)``: a delivery event was stored (from a
  provider's webhook, ``mail.record_event()``, or delivery itself: a recipient
  left out as suppressed, one refused as unknown). Sent once per stored event;
  a provider's resend of one already stored sends nothing. A webhook's events
  are sent after its request is answered.
* ``email_unsubscribed(app, address=str)``: the one-click unsubscribe link was
  used (after the address is suppressed for bulk mail); update the app's own
  preferences here.
* ``email_dispatched(app, message=DeliveredMessage)``: Flask-Mail 0.10's
  signal, in a namespace of its own as in Flask-Mail, sent after each
  successful delivery (the same moment and message as ``email_sent``), so a
  receiver written for Flask-Mail (``def on_dispatched(app, message)``) works
  once its import names ``flask_mail_outbox``.
"""

from __future__ import annotations

from blinker import Namespace

_signals = Namespace()

email_queued = _signals.signal("email-queued")
email_sent = _signals.signal("email-sent")
email_failed = _signals.signal("email-failed")
email_event = _signals.signal("email-event")
email_unsubscribed = _signals.signal("email-unsubscribed")

# Flask-Mail keeps its signal in its own namespace; so does the outbox.
_flask_mail_signals = Namespace()

email_dispatched = _flask_mail_signals.signal("email-dispatched")
